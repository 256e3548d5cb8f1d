// splitfuse_cpu.GraphCall: calls a graph that inductor compiled with its C++ wrapper (the graph of
// one token, engine/step_graphs.py) from C++, holding the arguments that never change (the
// weights: ~430 of the default model's ~440 with int4 weights, ~190 of ~200 in bfloat16).
//
// Inductor's own call goes through Python each step: a list of every argument, each int made a
// tensor, each tensor given a new handle by a pybind call (~0.4 ms of a one-token step under a
// sampling profiler; calling from here saved 0.15 ms of a 6.4 ms int4 step, alternated step by
// step on the default model, 2 cores). Here the fixed arguments are held as at::Tensor, and a
// step passes only its own (token ids, positions, the plan's tensors and sizes); the handles are
// made in C++ and the graph's entry point, `inductor_entry_impl` of its shared library, is called
// directly, as inductor's binding calls it: with the GIL held (the entry releases it while it
// runs), its input handles stolen, its output handles handed over.
//
// Nothing here checks that a step's tensors fit the graph: the caller does (DirectGraph), as the
// compiler's guards would.

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <torch/csrc/inductor/aoti_torch/tensor_converter.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

using Entry = void (*)(AtenTensorHandle* inputs, AtenTensorHandle* outputs);

// Holds the GIL for its scope (the entry point releases and takes it back itself).
struct HoldGil {
  PyGILState_STATE state = PyGILState_Ensure();
  HoldGil() = default;
  HoldGil(const HoldGil&) = delete;
  HoldGil& operator=(const HoldGil&) = delete;
  ~HoldGil() { PyGILState_Release(state); }
};

struct GraphCall : torch::CustomClassHolder {
  Entry entry;
  // every argument of the graph in its order; undefined where the step fills it in
  std::vector<at::Tensor> arguments;
  std::vector<int64_t> tensor_slots;  // where the step's tensors go, in the order they come
  std::vector<int64_t> size_slots;    // where the step's ints go (as int64 scalars)
  int64_t num_outputs;

  GraphCall(int64_t address, std::vector<std::optional<at::Tensor>> fixed,
            std::vector<int64_t> tensor_slots_, std::vector<int64_t> size_slots_,
            int64_t num_outputs_)
      : entry(reinterpret_cast<Entry>(address)),
        tensor_slots(std::move(tensor_slots_)),
        size_slots(std::move(size_slots_)),
        num_outputs(num_outputs_) {
    TORCH_CHECK(address != 0, "GraphCall: no entry point");
    TORCH_CHECK(num_outputs > 0, "GraphCall: a graph with no output");
    const int64_t n = static_cast<int64_t>(fixed.size());
    std::vector<int> filled(n, 0);
    arguments.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      filled[i] = fixed[i].has_value();
      arguments.push_back(fixed[i].has_value() ? *fixed[i] : at::Tensor());
    }
    for (const auto* slots : {&tensor_slots, &size_slots})
      for (int64_t slot : *slots) {
        TORCH_CHECK(slot >= 0 && slot < n && !filled[slot], "GraphCall: slot ", slot,
                    " is out of range or given twice");
        filled[slot] = 1;
      }
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(filled[i], "GraphCall: argument ", i, " unset");
  }

  std::vector<at::Tensor> run(std::vector<at::Tensor> tensors, std::vector<int64_t> sizes) {
    TORCH_CHECK(tensors.size() == tensor_slots.size(), "GraphCall: ", tensors.size(),
                " tensors for ", tensor_slots.size(), " slots");
    TORCH_CHECK(sizes.size() == size_slots.size(), "GraphCall: ", sizes.size(), " sizes for ",
                size_slots.size(), " slots");
    std::vector<at::Tensor> inputs(arguments);
    for (size_t i = 0; i < tensors.size(); ++i) inputs[tensor_slots[i]] = std::move(tensors[i]);
    for (size_t i = 0; i < sizes.size(); ++i)
      inputs[size_slots[i]] = at::scalar_tensor(sizes[i], at::kLong);
    std::vector<AtenTensorHandle> handles =
        torch::aot_inductor::unsafe_alloc_new_handles_from_tensors(inputs);
    inputs.clear();  // the graph frees a step's inputs once it is done with them
    std::vector<AtenTensorHandle> outputs(num_outputs, nullptr);
    {
      HoldGil gil;
      entry(handles.data(), outputs.data());  // steals the input handles
    }
    return torch::aot_inductor::alloc_tensors_by_stealing_from_handles(outputs.data(),
                                                                       outputs.size());
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  m.class_<GraphCall>("GraphCall")
      .def(torch::init<int64_t, std::vector<std::optional<at::Tensor>>, std::vector<int64_t>,
                       std::vector<int64_t>, int64_t>())
      .def("run", &GraphCall::run);
}
