// The Python module of the project's CPU kernels (services/cpu_kernels.py).
#include "ops.h"

// Every entry runs without the GIL (the arguments are converted before, the result after): a tier's compute
// thread runs these while its event loop thread serves gRPC, and holding the GIL through a layer would stall
// the loop for the layer's length and the next layer behind the loop's Python work.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear", &dspark::linear, "y = x wᵀ + b, each output one fixed-order dot product", nogil);
  m.def("amx_usable", &dspark::amx_usable, "whether AMX-BF16 tiles serve bf16 linears here", nogil);
  m.def("pack_amx", &dspark::pack_amx, "a bf16 weight [N, K] in the AMX tile layout", nogil);
  m.def("markov_block", &dspark::markov_block, "a block of DSpark's Markov head, its steps in one call", nogil);
  m.def("rms_norm", &dspark::rms_norm, "RMSNorm of rows, rounded as the decoder layer's", nogil);
  m.def("context_rows", &dspark::context_rows, "context rows' keys and values into a cache slot", nogil);
  m.def("decoder_layer", &dspark::decoder_layer, "one Llama decoder layer over a step's rows and a slot KV cache", nogil);
}
