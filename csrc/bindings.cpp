// fastpo._C: the C++ batch simulator. Python validates inputs first (envs/base.py check_*); these bindings
// re-check dtype, contiguity and shape strictly (no silent conversion) and release the GIL for all work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <memory>
#include <string>
#include <vector>

#include "coords.h"
#include "frozenlake.h"
#include "game2048.h"
#include "rubiks.h"
#include "sokoban.h"
#include "sudoku.h"

namespace py = pybind11;
using fastpo::FrozenLakeBatch;
using fastpo::Game2048Batch;
using fastpo::RubiksBatch;
using fastpo::SokobanBatch;
using fastpo::SokobanParams;
using fastpo::SudokuAction;
using fastpo::SudokuBatch;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

// Returns `obj` as a C-contiguous array of T with the given shape; ValueError otherwise (never converts).
template <typename T>
CArray<T> strict_array(const py::handle& obj, const std::vector<py::ssize_t>& shape, const char* name);

// strict_array for 1-D arrays: the common case (an exact ndarray of the right dtype, shape and layout) is
// checked without building any message or shape vector; anything else goes through strict_array's errors.
template <typename T>
CArray<T> strict_array_1d(const py::handle& obj, py::ssize_t n, const char* name) {
  if (py::isinstance<py::array_t<T>>(obj)) {
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (arr.ndim() == 1 && arr.shape(0) == n && (arr.flags() & py::array::c_style))
      return py::reinterpret_borrow<CArray<T>>(arr);
  }
  return strict_array<T>(obj, {n}, name);
}

template <typename T>
CArray<T> strict_array(const py::handle& obj, const std::vector<py::ssize_t>& shape, const char* name) {
  const std::string expected = py::str(py::dtype::of<T>()).cast<std::string>();
  if (!py::isinstance<py::array>(obj))
    throw py::value_error(std::string(name) + " must be a numpy array of dtype " + expected + ", got " +
                          py::str(py::type::of(obj)).cast<std::string>());
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::isinstance<py::array_t<T>>(arr))
    throw py::value_error(std::string(name) + " must have dtype " + expected + ", got " +
                          py::str(arr.dtype()).cast<std::string>());
  std::vector<py::ssize_t> got(arr.shape(), arr.shape() + arr.ndim());
  if (got != shape) {
    std::string s = "(", g = "(";
    for (auto d : shape) s += std::to_string(d) + ",";
    for (auto d : got) g += std::to_string(d) + ",";
    throw py::value_error(std::string(name) + " must have shape " + s + ") , got " + g + ")");
  }
  if (!(arr.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  return py::reinterpret_borrow<CArray<T>>(arr);
}

// Text observations built straight into Python str objects from per-cell render codes: each code maps to a
// symbol (a sequence of code points); rows are joined by '\n'. Equal to decoding the UTF-8 render.
struct SymbolTable {
  std::u32string cps[256];  // code points per render code
  Py_UCS4 maxchar[256] = {};
  Py_UCS4 single[256] = {};  // the code point when every symbol is exactly one
  bool all_single = true;
  std::vector<uint8_t> wide_codes;  // codes whose symbol has a code point >= 128 (few: found with memchr)

  explicit SymbolTable(const std::vector<std::u32string>& symbols) {
    for (size_t k = 0; k < 256; ++k) {
      cps[k] = k < symbols.size() ? symbols[k] : std::u32string(U"?");
      for (char32_t c : cps[k]) maxchar[k] = std::max<Py_UCS4>(maxchar[k], c);
      if (cps[k].size() != 1) all_single = false;
      single[k] = cps[k].empty() ? 0 : cps[k][0];
      if (maxchar[k] >= 128) wide_codes.push_back(static_cast<uint8_t>(k));
    }
  }
};

// Decodes valid UTF-8 (as pybind11 produces from Python str) into code points.
std::u32string decode_utf8(const std::string& s) {
  std::u32string out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    if (i + len > s.size()) throw std::invalid_argument("symbol is not valid UTF-8");
    char32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    for (int k = 1; k < len; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(c);
    i += len;
  }
  return out;
}

template <typename CharT>
void write_single(CharT* dst, const uint8_t* codes, int rows, int cols, const SymbolTable& t) {
  for (int r = 0; r < rows; ++r) {
    if (r > 0) *dst++ = static_cast<CharT>('\n');
    for (int c = 0; c < cols; ++c) *dst++ = static_cast<CharT>(t.single[*codes++]);
  }
}

// codes: n * rows * cols render codes -> list of n str.
py::list build_observations(const uint8_t* codes, int64_t n, int rows, int cols, const SymbolTable& t) {
  const int64_t cells = static_cast<int64_t>(rows) * cols;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (list == nullptr) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* cc = codes + i * cells;
    // Only the kind matters to PyUnicode_New (ASCII / 1 / 2 / 4 bytes), so an all-ASCII render may claim 127.
    Py_UCS4 maxchar = 127;
    for (uint8_t w : t.wide_codes)
      if (std::memchr(cc, w, static_cast<size_t>(cells)) != nullptr) maxchar = std::max(maxchar, t.maxchar[w]);
    Py_ssize_t len = rows - 1;
    if (t.all_single) {
      len += cells;
    } else {
      for (int64_t k = 0; k < cells; ++k) len += static_cast<Py_ssize_t>(t.cps[cc[k]].size());
    }
    PyObject* str = PyUnicode_New(len, maxchar);
    if (str == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), str);  // steals; the list owns it from here
    const int kind = PyUnicode_KIND(str);
    if (t.all_single && kind == PyUnicode_1BYTE_KIND) {
      write_single(PyUnicode_1BYTE_DATA(str), cc, rows, cols, t);
    } else if (t.all_single && kind == PyUnicode_2BYTE_KIND) {
      write_single(PyUnicode_2BYTE_DATA(str), cc, rows, cols, t);
    } else {
      void* data = PyUnicode_DATA(str);
      Py_ssize_t pos = 0;
      for (int r = 0; r < rows; ++r) {
        if (r > 0) PyUnicode_WRITE(kind, data, pos++, '\n');
        for (int c = 0; c < cols; ++c)
          for (char32_t ch : t.cps[*cc++]) PyUnicode_WRITE(kind, data, pos++, ch);
      }
    }
  }
  return out;
}

const SymbolTable& frozenlake_symbols() {
  static const SymbolTable table({U"_", U"O", U"G", U"P", U"X", U"\u221A"});  // see FrozenLakeBatch::render_codes
  return table;
}

// The table of the last symbol set seen (every batch of a run usually shares one); guarded by the GIL.
const SymbolTable& sokoban_symbols(const SokobanBatch& b) {
  static std::vector<std::string> key;
  static std::unique_ptr<SymbolTable> table;
  if (!table || key != b.symbols()) {
    std::vector<std::u32string> symbols;
    for (const auto& s : b.symbols()) symbols.push_back(decode_utf8(s));
    table = std::make_unique<SymbolTable>(symbols);
    key = b.symbols();
  }
  return *table;
}

// RAGEN's coordinate formats on top of the symbol grids: "coord" is the coordinate text alone, "grid_coord"
// is "Coordinates: \n" + coordinates + "\nGrid Map: \n" + grid (join_grid_coord).
template <typename Batch>
py::list with_coordinates(Batch& b, py::list grids) {
  const int64_t n = b.num_envs();
  std::vector<std::string> coords(static_cast<size_t>(n));
  {
    py::gil_scoped_release release;
    b.coord_texts(coords.data());
    if (b.obs_format() == fastpo::kObsGridCoord)
      for (auto& c : coords) c = fastpo::join_grid_coord(c, "");  // the grid str is appended below
  }
  py::list out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    PyObject* head = PyUnicode_FromStringAndSize(coords[i].data(), static_cast<Py_ssize_t>(coords[i].size()));
    if (head == nullptr) throw py::error_already_set();
    py::object text = py::reinterpret_steal<py::object>(head);
    if (b.obs_format() == fastpo::kObsGridCoord) {
      PyObject* joined = PyUnicode_Concat(text.ptr(), grids[static_cast<size_t>(i)].ptr());
      if (joined == nullptr) throw py::error_already_set();
      text = py::reinterpret_steal<py::object>(joined);
    }
    out[static_cast<size_t>(i)] = text;
  }
  return out;
}

// Render codes of every instance (GIL released), then the str objects (GIL held).
py::list render_observations(FrozenLakeBatch& b) {
  const int s = b.size();
  std::vector<uint8_t> codes(static_cast<size_t>(b.num_envs()) * s * s);
  {
    py::gil_scoped_release release;
    b.render_codes(codes.data());
  }
  py::list grids = build_observations(codes.data(), b.num_envs(), s, s, frozenlake_symbols());
  return b.obs_format() == fastpo::kObsGrid ? grids : with_coordinates(b, grids);
}

py::list render_observations(SokobanBatch& b) {
  const int rows = b.params().rows, cols = b.params().cols;
  std::vector<uint8_t> codes(static_cast<size_t>(b.num_envs()) * rows * cols);
  {
    py::gil_scoped_release release;
    b.render_codes(codes.data());
  }
  py::list grids = build_observations(codes.data(), b.num_envs(), rows, cols, sokoban_symbols(b));
  return b.obs_format() == fastpo::kObsGrid ? grids : with_coordinates(b, grids);
}

// Decodes UTF-8 that C++ wrote (valid by construction) straight into a str of the right kind: the widest lead
// byte gives the kind (>= 0xF0: 4-byte units, >= 0xC4: 2-byte, else 1-byte) and the bytes that are not
// continuation bytes give the length. Equal to PyUnicode_DecodeUTF8, without its scan for errors and its widening
// as it meets wider characters. ASCII runs go 16 bytes at a time with SSE2 (a render is mostly ASCII with a mark
// or two, which makes the whole str 2-byte).
template <typename CharT>
void widen_utf8(CharT* out, const unsigned char* s, size_t n) {
  size_t k = 0;
  while (k < n) {
#ifdef __SSE2__
    if (sizeof(CharT) == 2 && k + 16 <= n) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k));
      if (_mm_movemask_epi8(v) == 0) {
        const __m128i zero = _mm_setzero_si128();
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(v, zero));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm_unpackhi_epi8(v, zero));
        out += 16;
        k += 16;
        continue;
      }
    }
#endif
    const unsigned char b = s[k];
    const int len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    uint32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    for (int j = 1; j < len; ++j) c = (c << 6) | (s[k + j] & 0x3F);
    *out++ = static_cast<CharT>(c);
    k += static_cast<size_t>(len);
  }
}

PyObject* str_from_utf8(const char* text, size_t n) {
  const auto* s = reinterpret_cast<const unsigned char*>(text);
  unsigned char top = 0;
  size_t continuation = 0;
  size_t k = 0;
#ifdef __SSE2__
  // Continuation bytes are counted with sums of absolute differences (no popcount: baseline x86-64 lacks it).
  __m128i vmax = _mm_setzero_si128(), vcount = _mm_setzero_si128();
  const __m128i zero = _mm_setzero_si128(), one = _mm_set1_epi8(1);
  const __m128i top2 = _mm_set1_epi8(static_cast<char>(0xC0)), cont = _mm_set1_epi8(static_cast<char>(0x80));
  for (; k + 16 <= n; k += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k));
    vmax = _mm_max_epu8(vmax, v);
    const __m128i is_cont = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, top2), cont), one);
    vcount = _mm_add_epi64(vcount, _mm_sad_epu8(is_cont, zero));
  }
  alignas(16) unsigned char lanes[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), vmax);
  for (unsigned char lane : lanes) top = std::max(top, lane);
  alignas(16) uint64_t counts[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(counts), vcount);
  continuation = static_cast<size_t>(counts[0] + counts[1]);
#endif
  for (; k < n; ++k) {
    top = std::max(top, s[k]);
    continuation += (s[k] & 0xC0) == 0x80;
  }
  const auto len = static_cast<Py_ssize_t>(n - continuation);
  PyObject* str = PyUnicode_New(len, top < 0x80 ? 127 : top < 0xC4 ? 255 : top < 0xF0 ? 0xFFFF : 0x10FFFF);
  if (str == nullptr) throw py::error_already_set();
  switch (PyUnicode_KIND(str)) {
    case PyUnicode_1BYTE_KIND:
      if (top < 0x80) {
        std::memcpy(PyUnicode_1BYTE_DATA(str), s, n);
      } else {
        widen_utf8(PyUnicode_1BYTE_DATA(str), s, n);
      }
      break;
    case PyUnicode_2BYTE_KIND:
      widen_utf8(PyUnicode_2BYTE_DATA(str), s, n);
      break;
    default:
      widen_utf8(PyUnicode_4BYTE_DATA(str), s, n);
  }
  return str;
}

// Text observations built whole in C++ (2048, Sudoku, the cube): the texts of a chunk of instances (GIL released),
// then their str objects, chunk after chunk. The texts live in a per-thread scratch that keeps its memory, so a
// render allocates only the str objects; a chunk's scratch stays in cache until its strs are made (rendering all
// 1024 Sudoku texts first, then converting, went through memory twice: about 15% slower).
template <typename Batch>
py::list render_observations_text(Batch& b) {
  thread_local fastpo::TextBatch texts;
  const int64_t n = b.num_envs(), chunk = int64_t{128} * b.num_threads();
  texts.resize(static_cast<size_t>(std::min(n, chunk)));
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (list == nullptr) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);  // unset items are NULL, which the list's dealloc skips
  for (int64_t first = 0; first < n; first += chunk) {
    texts.first = first;
    texts.count = std::min(chunk, n - first);
    {
      py::gil_scoped_release release;
      b.render_texts(texts);
    }
    for (int64_t k = 0; k < texts.count; ++k)
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(first + k), str_from_utf8(texts.buf[k].data(), texts.len[k]));
  }
  return out;
}

py::list render_observations(Game2048Batch& b) { return render_observations_text(b); }
py::list render_observations(SudokuBatch& b) { return render_observations_text(b); }
py::list render_observations(RubiksBatch& b) { return render_observations_text(b); }

template <typename T>
py::array_t<T> copy_out(const std::vector<T>& v, const std::vector<py::ssize_t>& shape) {
  py::array_t<T> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// A per-instance counter (any integer type) as int64[n]: the draw counters of the random streams, which Python
// reads as int64 whatever their C++ width.
template <typename T>
py::array_t<int64_t> copy_counter(const std::vector<T>& v, py::ssize_t n) {
  return copy_out(std::vector<int64_t>(v.begin(), v.end()), {n});
}

py::array_t<bool> copy_bool(const std::vector<uint8_t>& v) {
  py::array_t<bool> out(static_cast<py::ssize_t>(v.size()));
  bool* dst = out.mutable_data();
  for (size_t i = 0; i < v.size(); ++i) dst[i] = v[i] != 0;
  return out;
}

template <typename Batch>
void require_ready(const Batch& b) {
  if (!b.all_ready())
    throw std::runtime_error("some instances were never reset; call reset() or reset_from_layouts() first");
}

// The step of any batch once its actions are decoded: step(a) is b.step(a, reward, the five flag arrays) and runs
// without the GIL. Returns (obs or None when render=False, reward f32[N], terminated, truncated, success, valid,
// effective bool[N]).
template <typename Batch, typename Actions>
py::tuple run_step(Batch& b, const Actions* actions, bool render) {
  const py::ssize_t n = b.num_envs();
  require_ready(b);
  py::array_t<float> reward(n);
  // One allocation for the five flag arrays: bool[5, N], returned as its row views (each owns a reference
  // to the block, so they stay valid independently).
  py::array_t<bool> block({py::ssize_t{5}, n});
  uint8_t* base = reinterpret_cast<uint8_t*>(block.mutable_data());
  float* r = reward.mutable_data();
  {
    py::gil_scoped_release release;
    b.step(actions, r, base, base + n, base + 2 * n, base + 3 * n, base + 4 * n);
  }
  auto row = [&](int k) {
    return py::array_t<bool>({n}, {py::ssize_t{1}}, reinterpret_cast<bool*>(base + k * n), block);
  };
  py::object obs_out = render ? py::object(render_observations(b)) : py::object(py::none());
  return py::make_tuple(obs_out, reward, row(0), row(1), row(2), row(3), row(4));
}

// step() of a batch with int32 action ids.
template <typename Batch>
py::tuple step_batch(Batch& b, const py::handle& actions_obj, bool render) {
  auto actions = strict_array_1d<int32_t>(actions_obj, b.num_envs(), "actions");
  return run_step(b, actions.data(), render);
}

// Sudoku's step: text actions parsed here (ASCII in C++; other text, or a number too long for int64, by the
// Python callable `parse`, which returns (kind, row, col, num, error) as SudokuAction), then stepped without the GIL.
py::tuple sudoku_step(SudokuBatch& b, const py::handle& actions_obj, const py::handle& active_obj, bool render,
                      const py::handle& parse) {
  const py::ssize_t n = b.num_envs();
  if (!PyList_Check(actions_obj.ptr()) || PyList_GET_SIZE(actions_obj.ptr()) != n)
    throw py::value_error("actions must be a list of " + std::to_string(n) + " str");
  const uint8_t* active = nullptr;
  CArray<bool> active_arr;
  if (!active_obj.is_none()) {
    active_arr = strict_array<bool>(active_obj, {n}, "active");
    active = reinterpret_cast<const uint8_t*>(active_arr.data());
  }
  // Kept between calls: the parser sets every field it reads back (the error only with kind 2). Nothing is stepped
  // before every item has been checked, so a bad item leaves the batch as it was.
  thread_local std::vector<SudokuAction> acts;
  acts.resize(static_cast<size_t>(n));
  for (py::ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(actions_obj.ptr(), i);
    if (!PyUnicode_Check(item))
      throw py::value_error(
          "actions[" + std::to_string(i) + "] must be a str, got " +
          py::handle(reinterpret_cast<PyObject*>(Py_TYPE(item))).attr("__name__").cast<std::string>());
    if (active != nullptr && !active[i]) {
      acts[i].kind = 0;
      continue;
    }
    bool done = false;
    if (PyUnicode_IS_COMPACT_ASCII(item)) {  // its characters are its bytes: no UTF-8 conversion to ask for
      const auto* data = static_cast<const char*>(PyUnicode_DATA(item));
      done = fastpo::parse_sudoku_action(data, static_cast<size_t>(PyUnicode_GET_LENGTH(item)), b.grid_size(), acts[i]);
    }
    if (!done) {
      auto t = parse(py::reinterpret_borrow<py::str>(item)).cast<py::tuple>();
      acts[i].kind = t[0].cast<int>();
      acts[i].row = t[1].cast<int>();
      acts[i].col = t[2].cast<int>();
      acts[i].num = t[3].cast<int>();
      acts[i].error = t[4].cast<std::string>();
    }
  }
  return run_step(b, acts.data(), render);
}

template <typename Batch>
py::list render_batch(Batch& b) {
  require_ready(b);
  return render_observations(b);
}

// state_keys() for either batch: uint64[N], one exact key per instance (see state_key.h).
template <typename Batch>
py::array_t<uint64_t> state_keys_batch(Batch& b) {
  require_ready(b);
  py::array_t<uint64_t> keys(b.num_envs());
  uint64_t* k = keys.mutable_data();
  {
    py::gil_scoped_release release;
    b.state_keys(k);
  }
  return keys;
}

template <typename Batch>
py::list reset_batch(Batch& b, const py::handle& seeds_obj, const py::handle& mask_obj) {
  const py::ssize_t n = b.num_envs();
  auto seeds = strict_array_1d<int64_t>(seeds_obj, n, "seeds");
  const uint8_t* mask = nullptr;
  CArray<bool> mask_arr;
  if (!mask_obj.is_none()) {
    mask_arr = strict_array<bool>(mask_obj, {n}, "mask");
    mask = reinterpret_cast<const uint8_t*>(mask_arr.data());
  }
  const int64_t* s = seeds.data();
  {
    py::gil_scoped_release release;
    b.reset(s, mask);
  }
  return render_batch(b);
}

SokobanParams make_params(int rows, int cols, int num_boxes, int search_depth, double p_change_directions,
                          int num_gen_steps) {
  SokobanParams p;
  p.rows = rows;
  p.cols = cols;
  p.num_boxes = num_boxes;
  p.search_depth = search_depth;
  p.p_change_directions = p_change_directions;
  p.num_gen_steps = num_gen_steps;
  p.validate();
  return p;
}

// What every batch class binds alike: num_envs, reset, render, state_keys and get_state. `fields(b, d, n)` puts
// the game's own arrays into the exact state; the episode fields (num_steps, terminated, truncated) are added here.
template <typename Batch, typename Fields>
void bind_batch(py::class_<Batch>& cls, const char* keys_doc, Fields fields) {
  cls.def_property_readonly("num_envs", [](const Batch& b) { return b.num_envs(); })
      .def("reset", &reset_batch<Batch>, py::arg("seeds"), py::arg("mask") = py::none(),
           "seeds int64[N], mask bool[N] or None -> list of N observations (instances reset in parallel).")
      .def("render", &render_batch<Batch>)
      .def("state_keys", &state_keys_batch<Batch>, keys_doc)
      .def("get_state", [fields](Batch& b) {
        require_ready(b);
        const py::ssize_t n = b.num_envs();
        py::dict d;
        fields(b, d, n);
        d["num_steps"] = copy_out(b.num_steps, {n});
        d["terminated"] = copy_bool(b.terminated);
        d["truncated"] = copy_bool(b.truncated);
        return d;
      });
}

// step() of the batches with integer action ids (all but Sudoku, whose actions are text); `doc` names the ids.
template <typename Batch>
void bind_discrete_step(py::class_<Batch>& cls, const char* doc) {
  cls.def("step", &step_batch<Batch>, py::arg("actions"), py::arg("render") = true, doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "fastpo C++ batch simulator: Sokoban, FrozenLake, 2048, Sudoku and the 2x2 cube with RAGEN's rules (see envs/).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  // The step docstrings: "<the ids> -> " then this.
#define FASTPO_STEP_RETURNS \
  " -> (obs, reward f32[N], terminated, truncated, success, action_is_valid, action_is_effective bool[N])."

  py::class_<SokobanBatch> sokoban(m, "SokobanBatch", "num_envs Sokoban instances (cell codes 0..5 as gym-sokoban).");
  sokoban
      .def(py::init([](int num_envs, int rows, int cols, int num_boxes, int search_depth, int max_steps,
                       std::vector<std::string> symbols, int num_threads, double p_change_directions,
                       int num_gen_steps, int observation_format) {
             return new SokobanBatch(
                 num_envs, make_params(rows, cols, num_boxes, search_depth, p_change_directions, num_gen_steps),
                 max_steps, std::move(symbols), num_threads, observation_format);
           }),
           py::arg("num_envs"), py::arg("rows"), py::arg("cols"), py::arg("num_boxes"), py::arg("search_depth"),
           py::arg("max_steps"), py::arg("symbols"), py::arg("num_threads") = 1,
           py::arg("p_change_directions") = 0.35, py::arg("num_gen_steps") = -1, py::arg("observation_format") = 0,
           "symbols: 7 strings for codes 0..6; num_gen_steps < 0 means int(1.7 * (rows + cols)); "
           "observation_format 0 grid, 1 coord, 2 grid_coord.")
      .def(
          "set_layouts",
          [](SokobanBatch& b, const py::handle& fixed_obj, const py::handle& state_obj) {
            const py::ssize_t n = b.num_envs(), r = b.params().rows, c = b.params().cols;
            auto fixed = strict_array<uint8_t>(fixed_obj, {n, r, c}, "room_fixed");
            auto state = strict_array<uint8_t>(state_obj, {n, r, c}, "room_state");
            b.set_layouts(fixed.data(), state.data());
            return render_batch(b);
          },
          py::arg("room_fixed"), py::arg("room_state"), "uint8[N, R, C] each -> list of N observations.");
  bind_batch(sokoban, "uint64[N]: FNV-1a 64 of room_fixed then room_state (the exact state without the step counter).",
             [](SokobanBatch& b, py::dict& d, py::ssize_t n) {
               const py::ssize_t r = b.params().rows, c = b.params().cols;
               d["room_fixed"] = copy_out(b.room_fixed, {n, r, c});
               d["room_state"] = copy_out(b.room_state, {n, r, c});
               d["boxes_on_target"] = copy_out(b.boxes_on_target, {n});
             });
  bind_discrete_step(sokoban, "int32[N] ids (1 Up, 2 Down, 3 Left, 4 Right)" FASTPO_STEP_RETURNS);

  m.def(
      "generate_sokoban",
      [](int64_t seed, int rows, int cols, int num_boxes, int search_depth, double p_change_directions,
         int num_gen_steps) {
        fastpo::SokobanGenerator gen(
            make_params(rows, cols, num_boxes, search_depth, p_change_directions, num_gen_steps));
        py::array_t<uint8_t> fixed({rows, cols}), state({rows, cols});
        uint8_t* f = fixed.mutable_data();
        uint8_t* s = state.mutable_data();
        int attempt;
        {
          py::gil_scoped_release release;
          attempt = gen.generate(static_cast<uint64_t>(seed), f, s);
        }
        return py::make_tuple(fixed, state, attempt);
      },
      py::arg("seed"), py::arg("rows") = 6, py::arg("cols") = 6, py::arg("num_boxes") = 1,
      py::arg("search_depth") = 300, py::arg("p_change_directions") = 0.35, py::arg("num_gen_steps") = -1,
      "One level -> (room_fixed uint8[R, C], room_state uint8[R, C], attempt int).");

  py::class_<FrozenLakeBatch> frozenlake(m, "FrozenLakeBatch",
                                         "num_envs FrozenLake instances (maps as ASCII S F H G).");
  frozenlake
      .def(py::init<int, int, double, bool, int, int, double, int>(), py::arg("num_envs"), py::arg("size"),
           py::arg("p"), py::arg("is_slippery"), py::arg("max_steps"), py::arg("num_threads") = 1,
           py::arg("success_rate") = -1.0, py::arg("observation_format") = 0,
           "success_rate < 0: gym's 1/3 slip, else the intended move w.p. success_rate; observation_format 0 grid, "
           "1 coord, 2 grid_coord.")
      .def(
          "set_layouts",
          [](FrozenLakeBatch& b, const py::handle& desc_obj, const py::handle& start_obj, const py::handle& seeds_obj) {
            const py::ssize_t n = b.num_envs(), s = b.size();
            auto desc = strict_array<uint8_t>(desc_obj, {n, s, s}, "desc");
            auto start = strict_array<int32_t>(start_obj, {n}, "start");
            auto seeds = strict_array<int64_t>(seeds_obj, {n}, "seeds");
            b.set_layouts(desc.data(), start.data(), seeds.data());
            return render_batch(b);
          },
          py::arg("desc"), py::arg("start"), py::arg("seeds"),
          "desc uint8[N, S, S] ASCII, start int32[N] cells, seeds int64[N] (slip streams) -> observations.");
  bind_batch(frozenlake, "uint64[N]: FNV-1a 64 of the map then the player cell (int32 little-endian).",
             [](FrozenLakeBatch& b, py::dict& d, py::ssize_t n) {
               const py::ssize_t s = b.size();
               d["desc"] = copy_out(b.desc, {n, s, s});
               d["position"] = copy_out(b.position, {n});
               d["slip_draws"] = copy_counter(b.slip_counter, n);
             });
  bind_discrete_step(frozenlake, "int32[N] ids (1 Left, 2 Down, 3 Right, 4 Up)" FASTPO_STEP_RETURNS);

  py::class_<Game2048Batch> game2048(m, "Game2048Batch", "num_envs 2048 boards (RAGEN-2's game_2048).");
  // set_boards, set_puzzles, set_cubes and set_layouts look alike, but each checks and copies its own arrays.
  game2048
      .def(py::init<int, int, double, bool, int, int>(), py::arg("num_envs"), py::arg("size"), py::arg("two_prob"),
           py::arg("use_log_reward"), py::arg("max_steps"), py::arg("num_threads") = 1)
      .def(
          "set_boards",
          [](Game2048Batch& b, const py::handle& tiles_obj, const py::handle& seeds_obj) {
            const py::ssize_t n = b.num_envs(), s = b.size();
            auto tiles = strict_array<int64_t>(tiles_obj, {n, s, s}, "tiles");
            auto seeds = strict_array<int64_t>(seeds_obj, {n}, "seeds");
            b.set_boards(tiles.data(), seeds.data());
            return render_batch(b);
          },
          py::arg("tiles"), py::arg("seeds"),
          "tiles int64[N, S, S] (0 or powers of two), seeds int64[N] (spawn streams) -> observations.");
  bind_batch(game2048, "uint64[N]: FNV-1a 64 of the tile exponents then the score (int64 little-endian).",
             [](Game2048Batch& b, py::dict& d, py::ssize_t n) {
               const py::ssize_t s = b.size();
               std::vector<int64_t> tiles(b.exps.size());
               for (size_t c = 0; c < tiles.size(); ++c) tiles[c] = b.exps[c] == 0 ? 0 : int64_t{1} << b.exps[c];
               d["grid"] = copy_out(tiles, {n, s, s});
               d["score"] = copy_out(b.score, {n});
               d["spawn_draws"] = copy_counter(b.spawn_counter, n);
             });
  bind_discrete_step(game2048, "int32[N] ids (1 Up, 2 Right, 3 Down, 4 Left)" FASTPO_STEP_RETURNS);

  py::class_<SudokuBatch> sudoku(m, "SudokuBatch", "num_envs Sudoku puzzles (RAGEN-2's sudoku env).");
  sudoku
      .def(py::init([](int num_envs, int grid_size, int cells_to_remove, int max_steps, int render_format,
                       bool show_conflicts, bool show_valid_numbers, double correct_score, double invalid_score,
                       double completion_bonus, int num_threads) {
             fastpo::SudokuRender render{render_format, show_conflicts, show_valid_numbers};
             return new SudokuBatch(num_envs, grid_size, cells_to_remove, max_steps, render, correct_score,
                                    invalid_score, completion_bonus, num_threads);
           }),
           py::arg("num_envs"), py::arg("grid_size"), py::arg("cells_to_remove"), py::arg("max_steps"),
           py::arg("render_format"), py::arg("show_conflicts"), py::arg("show_valid_numbers"),
           py::arg("correct_score"), py::arg("invalid_score"), py::arg("completion_bonus"), py::arg("num_threads") = 1,
           "render_format 0 simple, 1 detailed, 2 with_feedback.")
      .def(
          "set_puzzles",
          [](SudokuBatch& b, const py::handle& initial_obj, const py::handle& solution_obj) {
            const py::ssize_t n = b.num_envs(), g = b.grid_size();
            auto initial = strict_array<uint8_t>(initial_obj, {n, g, g}, "initial");
            auto solution = strict_array<uint8_t>(solution_obj, {n, g, g}, "solution");
            b.set_puzzles(initial.data(), solution.data());
            return render_batch(b);
          },
          py::arg("initial"), py::arg("solution"), "uint8[N, G, G] each (validated by the caller) -> observations.")
      .def("step", &sudoku_step, py::arg("actions"), py::arg("active"), py::arg("render"), py::arg("parse"),
           "list of N str, active bool[N] or None, render, the Python parser for non-ASCII text" FASTPO_STEP_RETURNS);
  bind_batch(sudoku, "uint64[N]: FNV-1a 64 of the puzzle then the current grid.",
             [](SudokuBatch& b, py::dict& d, py::ssize_t n) {
               const py::ssize_t g = b.grid_size();
               d["initial"] = copy_out(b.initial, {n, g, g});
               d["current"] = copy_out(b.current, {n, g, g});
               d["solution"] = copy_out(b.solution, {n, g, g});
             });

  py::class_<RubiksBatch> rubiks(m, "RubiksBatch", "num_envs 2x2 Rubik's cubes (RAGEN-2's rubikscube).");
  rubiks
      .def(py::init<int, int, int, int>(), py::arg("num_envs"), py::arg("scramble_depth"), py::arg("max_steps"),
           py::arg("num_threads") = 1)
      .def(
          "set_cubes",
          [](RubiksBatch& b, const py::handle& obj) {
            auto stickers = strict_array<uint8_t>(obj, {b.num_envs(), 24}, "stickers");
            b.set_cubes(stickers.data());
            return render_batch(b);
          },
          py::arg("stickers"), "uint8[N, 24] colours 0..5 (checked by the caller) -> observations.");
  bind_batch(rubiks, "uint64[N]: FNV-1a 64 of the 24 stickers.", [](RubiksBatch& b, py::dict& d, py::ssize_t n) {
    d["stickers"] = copy_out(b.stickers, {n, 24});
  });
  bind_discrete_step(rubiks, "int32[N] ids 1..12 (U U' D D' L L' R R' F F' B B')" FASTPO_STEP_RETURNS);
#undef FASTPO_STEP_RETURNS

  m.def(
      "generate_frozenlake",
      [](int64_t seed, int size, double p) {
        if (size < 2 || size > 64) throw py::value_error("size must be in [2, 64], got " + std::to_string(size));
        if (!(p > 0.0 && p <= 1.0)) throw py::value_error("p must be in (0, 1], got " + std::to_string(p));
        py::array_t<uint8_t> desc({size, size});
        uint8_t* d = desc.mutable_data();
        int start;
        {
          py::gil_scoped_release release;
          fastpo::FrozenLakeScratch scratch;
          start = fastpo::generate_frozenlake(static_cast<uint64_t>(seed), size, p, d, scratch);
        }
        return py::make_tuple(desc, start);
      },
      py::arg("seed"), py::arg("size") = 4, py::arg("p") = 0.8,
      "One map -> (desc uint8[S, S] ASCII of S F H G, start cell row * S + col).");
}
