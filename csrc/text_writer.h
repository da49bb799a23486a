// Text renders written straight into a byte buffer: a render is mostly fixed pieces and small numbers, and one
// std::string append (capacity check, length update) per piece costs more than the piece itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace fastpo {

// Writes at `p`; the caller sized the buffer for the text (see TextBatch::begin).
struct TextWriter {
  char* p;

  void put(const char* s, size_t n) {
    std::memcpy(p, s, n);
    p += n;
  }
  template <size_t N>
  void lit(const char (&s)[N]) {  // a string literal, its length known at compile time
    put(s, N - 1);
  }
  void str(const std::string& s) { put(s.data(), s.size()); }
  void ch(char c) { *p++ = c; }
  void fill(char c, size_t n) {
    std::memset(p, c, n);
    p += n;
  }
  // Decimal, as std::to_string.
  void num(int64_t v) {
    uint64_t u = v < 0 ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
    if (v < 0) *p++ = '-';
    char tmp[20];
    int k = 0;
    do {
      tmp[k++] = static_cast<char>('0' + u % 10);
      u /= 10;
    } while (u != 0);
    while (k > 0) *p++ = tmp[--k];
  }
};

// Rendered texts of the instances first .. first + count - 1: instance i's text is the first len[k] bytes of buf[k],
// k = i - first. A buffer keeps its size between renders (it only grows), so a render neither allocates nor
// zero-fills once the buffers have grown.
struct TextBatch {
  std::vector<std::string> buf;
  std::vector<size_t> len;
  int64_t first = 0, count = 0;

  void resize(size_t n) {
    if (buf.size() < n) {
      buf.resize(n);
      len.resize(n);
    }
  }
  // Starts the text of instance i, which needs at most `bound` bytes.
  TextWriter begin(int64_t i, size_t bound) {
    std::string& s = buf[static_cast<size_t>(i - first)];
    if (s.size() < bound) s.resize(bound);
    return TextWriter{&s[0]};
  }
  void end(int64_t i, const TextWriter& w) {
    const size_t k = static_cast<size_t>(i - first);
    len[k] = static_cast<size_t>(w.p - buf[k].data());
  }
  // Text i as a whole string (for renders built with std::string).
  void set(int64_t i, const std::string& s) {
    TextWriter w = begin(i, s.size());
    w.str(s);
    end(i, w);
  }
};

}  // namespace fastpo
