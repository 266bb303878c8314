// Placeholder: the embed_sinusoidal op is being written (issue 5). The module stub lets
// `import scratchformer._C` run the (future) TORCH_LIBRARY registrations.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(scratchformer, m) {}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
