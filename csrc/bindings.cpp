// fastpo._C: the C++ batch simulator. Python validates inputs first (envs/base.py check_*); these bindings
// re-check dtype, contiguity and shape strictly (no silent conversion) and release the GIL for all work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "frozenlake.h"
#include "sokoban.h"

namespace py = pybind11;
using fastpo::FrozenLakeBatch;
using fastpo::SokobanBatch;
using fastpo::SokobanParams;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

// Returns `obj` as a C-contiguous array of T with the given shape; ValueError otherwise (never converts).
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

py::list to_list(const std::vector<std::string>& strings) {
  py::list out(strings.size());
  for (size_t i = 0; i < strings.size(); ++i) out[i] = py::str(strings[i].data(), strings[i].size());
  return out;
}

template <typename T>
py::array_t<T> copy_out(const std::vector<T>& v, const std::vector<py::ssize_t>& shape) {
  py::array_t<T> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
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

// step() for either batch: (obs, reward f32[N], terminated, truncated, success, valid, effective bool[N]).
template <typename Batch>
py::tuple step_batch(Batch& b, const py::handle& actions_obj) {
  const py::ssize_t n = b.num_envs();
  auto actions = strict_array<int32_t>(actions_obj, {n}, "actions");
  require_ready(b);
  py::array_t<float> reward(n);
  py::array_t<bool> flags[5] = {py::array_t<bool>(n), py::array_t<bool>(n), py::array_t<bool>(n),
                                py::array_t<bool>(n), py::array_t<bool>(n)};
  uint8_t* ptr[5];
  for (int k = 0; k < 5; ++k) ptr[k] = reinterpret_cast<uint8_t*>(flags[k].mutable_data());
  const int32_t* a = actions.data();
  float* r = reward.mutable_data();
  std::vector<std::string> obs;
  {
    py::gil_scoped_release release;
    b.step(a, r, ptr[0], ptr[1], ptr[2], ptr[3], ptr[4]);
    b.render(obs);
  }
  return py::make_tuple(to_list(obs), reward, flags[0], flags[1], flags[2], flags[3], flags[4]);
}

template <typename Batch>
py::list render_batch(Batch& b) {
  require_ready(b);
  std::vector<std::string> obs;
  {
    py::gil_scoped_release release;
    b.render(obs);
  }
  return to_list(obs);
}

template <typename Batch>
py::list reset_batch(Batch& b, const py::handle& seeds_obj, const py::handle& mask_obj) {
  const py::ssize_t n = b.num_envs();
  auto seeds = strict_array<int64_t>(seeds_obj, {n}, "seeds");
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastpo C++ batch simulator: Sokoban and FrozenLake with RAGEN's rules (see envs/sokoban.py).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<SokobanBatch>(m, "SokobanBatch", "num_envs Sokoban instances (cell codes 0..5 as gym-sokoban).")
      .def(py::init([](int num_envs, int rows, int cols, int num_boxes, int search_depth, int max_steps,
                       std::vector<std::string> symbols, int num_threads, double p_change_directions,
                       int num_gen_steps) {
             return new SokobanBatch(
                 num_envs, make_params(rows, cols, num_boxes, search_depth, p_change_directions, num_gen_steps),
                 max_steps, std::move(symbols), num_threads);
           }),
           py::arg("num_envs"), py::arg("rows"), py::arg("cols"), py::arg("num_boxes"), py::arg("search_depth"),
           py::arg("max_steps"), py::arg("symbols"), py::arg("num_threads") = 1,
           py::arg("p_change_directions") = 0.35, py::arg("num_gen_steps") = -1,
           "symbols: 7 strings for codes 0..6; num_gen_steps < 0 means int(1.7 * (rows + cols)).")
      .def_property_readonly("num_envs", &SokobanBatch::num_envs)
      .def("reset", &reset_batch<SokobanBatch>, py::arg("seeds"), py::arg("mask") = py::none(),
           "seeds int64[N], mask bool[N] or None -> list of N observations. Generates in parallel.")
      .def(
          "set_layouts",
          [](SokobanBatch& b, const py::handle& fixed_obj, const py::handle& state_obj) {
            const py::ssize_t n = b.num_envs(), r = b.params().rows, c = b.params().cols;
            auto fixed = strict_array<uint8_t>(fixed_obj, {n, r, c}, "room_fixed");
            auto state = strict_array<uint8_t>(state_obj, {n, r, c}, "room_state");
            b.set_layouts(fixed.data(), state.data());
            return render_batch(b);
          },
          py::arg("room_fixed"), py::arg("room_state"), "uint8[N, R, C] each -> list of N observations.")
      .def("step", &step_batch<SokobanBatch>, py::arg("actions"),
           "int32[N] ids (1 Up, 2 Down, 3 Left, 4 Right) -> (obs, reward f32[N], terminated, truncated, success, "
           "action_is_valid, action_is_effective bool[N]).")
      .def("render", &render_batch<SokobanBatch>)
      .def("get_state", [](SokobanBatch& b) {
        require_ready(b);
        const py::ssize_t n = b.num_envs(), r = b.params().rows, c = b.params().cols;
        py::dict d;
        d["room_fixed"] = copy_out(b.room_fixed, {n, r, c});
        d["room_state"] = copy_out(b.room_state, {n, r, c});
        d["num_steps"] = copy_out(b.num_steps, {n});
        d["boxes_on_target"] = copy_out(b.boxes_on_target, {n});
        d["terminated"] = copy_bool(b.terminated);
        d["truncated"] = copy_bool(b.truncated);
        return d;
      });

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

  py::class_<FrozenLakeBatch>(m, "FrozenLakeBatch", "num_envs FrozenLake instances (maps as ASCII S F H G).")
      .def(py::init<int, int, double, bool, int, int>(), py::arg("num_envs"), py::arg("size"), py::arg("p"),
           py::arg("is_slippery"), py::arg("max_steps"), py::arg("num_threads") = 1)
      .def_property_readonly("num_envs", &FrozenLakeBatch::num_envs)
      .def("reset", &reset_batch<FrozenLakeBatch>, py::arg("seeds"), py::arg("mask") = py::none(),
           "seeds int64[N], mask bool[N] or None -> list of N observations.")
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
          "desc uint8[N, S, S] ASCII, start int32[N] cells, seeds int64[N] (slip streams) -> observations.")
      .def("step", &step_batch<FrozenLakeBatch>, py::arg("actions"),
           "int32[N] ids (1 Left, 2 Down, 3 Right, 4 Up) -> (obs, reward f32[N], terminated, truncated, success, "
           "action_is_valid, action_is_effective bool[N]).")
      .def("render", &render_batch<FrozenLakeBatch>)
      .def("get_state", [](FrozenLakeBatch& b) {
        require_ready(b);
        const py::ssize_t n = b.num_envs(), s = b.size();
        py::dict d;
        d["desc"] = copy_out(b.desc, {n, s, s});
        d["position"] = copy_out(b.position, {n});
        d["num_steps"] = copy_out(b.num_steps, {n});
        std::vector<int64_t> draws(b.slip_counter.begin(), b.slip_counter.end());
        d["slip_draws"] = copy_out(draws, {n});
        d["terminated"] = copy_bool(b.terminated);
        d["truncated"] = copy_bool(b.truncated);
        return d;
      });

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
