// The Python module of the project's CPU kernels (services/cpu_kernels.py).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &dspark::linear, "y = x wᵀ + b, each output one fixed-order dot product");
  m.def("amx_usable", &dspark::amx_usable, "whether AMX-BF16 tiles serve bf16 linears here");
  m.def("pack_amx", &dspark::pack_amx, "a bf16 weight [N, K] in the AMX tile layout");
  m.def("markov_block", &dspark::markov_block, "a block of DSpark's Markov head, its steps in one call");
  m.def("rms_norm", &dspark::rms_norm, "RMSNorm of rows, rounded as the decoder layer's");
  m.def("context_rows", &dspark::context_rows, "context rows' keys and values into a cache slot");
  m.def("decoder_layer", &dspark::decoder_layer, "one Llama decoder layer over a step's rows and a slot KV cache");
}
