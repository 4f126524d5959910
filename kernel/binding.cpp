// marlin-convert: torch binding of the Marlin GEMM launcher (kernel/marlin_gemm.cu).
//
// Checks every tensor (device, dtype, layout, shape) and the weight bits with a message that names the values,
// gathers A's columns for act-order, then calls the plain C++ launcher, whose own shape checks (k % 16, n % 64,
// group size, workspace size) come back as exceptions with the launcher's message.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "marlin_gemm.h"

namespace {

// Messages are formatted with snprintf into a char buffer and handed to TORCH_CHECK as one C string: on the H200
// image, TORCH_CHECK messages with integer or std::string pieces crashed the process (iostream formatting across
// the extension / libtorch boundary), while plain C-string messages worked.
struct Dims {
  char text[96];
  Dims(const torch::Tensor& t, bool strides = false) {
    int at = snprintf(text, sizeof(text), "[");
    for (int64_t d = 0; d < t.dim() && at < (int)sizeof(text); ++d)
      at += snprintf(text + at, sizeof(text) - at, "%s%lld", d ? ", " : "",
                     (long long)(strides ? t.stride(d) : t.size(d)));
    if (at < (int)sizeof(text)) snprintf(text + at, sizeof(text) - at, "]");
  }
};

#define MG_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) {                                           \
      char mg_msg_[512];                                     \
      snprintf(mg_msg_, sizeof(mg_msg_), __VA_ARGS__);       \
      TORCH_CHECK(false, static_cast<const char*>(mg_msg_)); \
    }                                                        \
  } while (0)

void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
  MG_CHECK(t.is_cuda(), "marlin_gemm: %s must be a CUDA tensor, got a tensor on %s", name,
           c10::DeviceTypeName(t.device().type(), true).c_str());
  MG_CHECK(t.device() == device, "marlin_gemm: %s is on cuda:%d but A is on cuda:%d", name, (int)t.device().index(),
           (int)device.index());
}

void check_dtype(const torch::Tensor& t, const char* name, at::ScalarType want) {
  MG_CHECK(t.scalar_type() == want, "marlin_gemm: %s must be %s, got %s", name, c10::toString(want),
           c10::toString(t.scalar_type()));
}

// Rows dense and elements contiguous: true for a contiguous tensor and for a slice `stacked[e]` of a contiguous
// [E, rows, cols] buffer (an expert of a stacked layer), which is used in place.
void check_dense_2d(const torch::Tensor& t, const char* name) {
  MG_CHECK(t.dim() == 2, "marlin_gemm: %s must be 2-D, got shape %s", name, Dims(t).text);
  MG_CHECK(t.size(1) == 0 || t.stride(1) == 1, "marlin_gemm: %s must have contiguous rows (stride(1) == 1), got "
           "strides %s", name, Dims(t, true).text);
  MG_CHECK(t.size(0) <= 1 || t.stride(0) == t.size(1), "marlin_gemm: %s must have dense rows (stride(0) == size(1) "
           "= %lld), got strides %s", name, (long long)t.size(1), Dims(t, true).text);
}

// Whether the memory of x and y (each dense: data_ptr() .. + numel() x element_size()) overlaps.
bool shares_memory(const torch::Tensor& x, const torch::Tensor& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const char* const x0 = static_cast<const char*>(x.data_ptr());
  const char* const y0 = static_cast<const char*>(y.data_ptr());
  return x0 < y0 + y.numel() * y.element_size() && y0 < x0 + x.numel() * x.element_size();
}

int multiprocessors(int device) {
  int sms = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  MG_CHECK(e == cudaSuccess, "marlin_gemm: cannot read the multiprocessor count of GPU %d: %s", device,
           cudaGetErrorString(e));
  return sms;
}

}  // namespace

// C[m, n] = A[m, k] (columns gathered by perm if given) @ dequant(B, s, zp). See marlin_convert/kernel.py.
torch::Tensor marlin_gemm(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& s,
                          const torch::Tensor& workspace, const c10::optional<torch::Tensor>& perm,
                          const c10::optional<torch::Tensor>& out, int64_t split_k,
                          const c10::optional<torch::Tensor>& zp, int64_t bits) {
  MG_CHECK(A.is_cuda(), "marlin_gemm: A must be a CUDA tensor, got a tensor on %s",
           c10::DeviceTypeName(A.device().type(), true).c_str());
  MG_CHECK(bits == 4 || bits == 8, "marlin_gemm: bits = %lld: the kernel takes 4- or 8-bit weights", (long long)bits);
  const torch::Device device = A.device();
  check_cuda(B, "B", device);
  check_cuda(s, "s", device);
  check_cuda(workspace, "workspace", device);
  MG_CHECK(A.scalar_type() == at::kHalf || A.scalar_type() == at::kBFloat16,
           "marlin_gemm: A must be Half or BFloat16, got %s", c10::toString(A.scalar_type()));
  const at::ScalarType act = A.scalar_type();
  check_dtype(B, "B", at::kInt);
  MG_CHECK(s.scalar_type() == act, "marlin_gemm: s must be %s (the dtype of A), got %s", c10::toString(act),
           c10::toString(s.scalar_type()));
  check_dtype(workspace, "workspace", at::kInt);
  check_dense_2d(A, "A");
  check_dense_2d(B, "B");
  check_dense_2d(s, "s");
  MG_CHECK(workspace.is_contiguous(), "marlin_gemm: workspace must be contiguous");

  // B is [k / 16, n * bits / 2]: 16 rows of k times n columns of `bits` bits per row, in int32 words
  const int64_t m = A.size(0), k = A.size(1);
  const int64_t b_per_n = bits / 2;  // B words per output column (2 for 4-bit, 4 for 8-bit)
  MG_CHECK(B.size(0) * 16 == k,
           "marlin_gemm: B has shape %s but A has k = %lld columns: B must be [k / 16, %lld n] (bits = %lld)%s",
           Dims(B).text, (long long)k, (long long)b_per_n, (long long)bits,
           (k % 16 ? " (k is not a multiple of 16)" : ""));
  MG_CHECK(B.size(1) % b_per_n == 0, "marlin_gemm: B has shape %s: with bits = %lld its width must be %lld n",
           Dims(B).text, (long long)bits, (long long)b_per_n);
  const int64_t n = B.size(1) / b_per_n;
  MG_CHECK(s.size(1) == n,
           "marlin_gemm: s has shape %s but B (bits = %lld, width %lld n) has n = %lld columns: s must be "
           "[k / group_size, n]",
           Dims(s).text, (long long)bits, (long long)b_per_n, (long long)n);
  MG_CHECK(s.size(0) >= 1, "marlin_gemm: s has no rows (shape %s)", Dims(s).text);
  MG_CHECK(k <= INT32_MAX && n <= INT32_MAX && m <= INT32_MAX, "marlin_gemm: sizes must fit in int32");
  const void* zp_ptr = nullptr;
  if (zp.has_value()) {
    const torch::Tensor& z = *zp;
    check_cuda(z, "zp", device);
    check_dtype(z, "zp", at::kInt);
    check_dense_2d(z, "zp");
    const int64_t z_cols = n * bits / 32;  // p = 32 / bits zero points per int32 word
    MG_CHECK(z.size(0) == s.size(0) && z.size(1) == z_cols,
             "marlin_gemm: zp has shape %s, expected [%lld, %lld] (the %lld scale rows of s, n = %lld columns / %lld "
             "per word at bits = %lld)",
             Dims(z).text, (long long)s.size(0), (long long)z_cols, (long long)s.size(0), (long long)n,
             (long long)(32 / bits), (long long)bits);
    zp_ptr = z.data_ptr();
  }

  torch::Tensor C;
  if (out.has_value()) {
    C = *out;
    check_cuda(C, "out", device);
    MG_CHECK(C.scalar_type() == act, "marlin_gemm: out must be %s (the dtype of A), got %s", c10::toString(act),
             c10::toString(C.scalar_type()));
    MG_CHECK(C.dim() == 2 && C.size(0) == m && C.size(1) == n, "marlin_gemm: out has shape %s, expected [%lld, %lld]",
             Dims(C).text, (long long)m, (long long)n);
    MG_CHECK(C.is_contiguous(), "marlin_gemm: out must be contiguous");
    // the kernel's blocks write out while others still read the operands (and the direct kernel keeps A in L1)
    const std::pair<const char*, const torch::Tensor*> operands[] = {
        {"A", &A}, {"B", &B}, {"s", &s}, {"workspace", &workspace}, {"zp", zp.has_value() ? &*zp : nullptr},
        {"perm", perm.has_value() ? &*perm : nullptr}};
    for (const auto& [name, t] : operands)
      MG_CHECK(t == nullptr || !shares_memory(C, *t), "marlin_gemm: out shares memory with %s: pass a separate buffer",
               name);
  } else {
    C = torch::empty({m, n}, A.options());
  }
  if (m == 0) return C;

  const c10::cuda::CUDAGuard guard(device);
  torch::Tensor a = A;
  if (perm.has_value()) {
    const torch::Tensor& p = *perm;
    check_cuda(p, "perm", device);
    check_dtype(p, "perm", at::kInt);
    MG_CHECK(p.dim() == 1 && p.size(0) == k, "marlin_gemm: perm has shape %s, expected [%lld]", Dims(p).text,
             (long long)k);
    a = A.index_select(1, p);  // act-order: A[:, perm], one gather before the GEMM
  }
  a = a.contiguous();

  char err[512];
  const int sms = multiprocessors(device.index());
  const int act_code = act == at::kHalf ? marlin_convert::MARLIN_ACT_FP16 : marlin_convert::MARLIN_ACT_BF16;
  const int status = marlin_convert::marlin_gemm_launch(
      a.data_ptr(), B.data_ptr(), s.data_ptr(), zp_ptr, C.data_ptr(), workspace.data_ptr<int>(),
      (long)workspace.numel(), (int)m, (int)n, (int)k, (int)s.size(0), (int)bits, act_code, sms, (int)split_k,
      c10::cuda::getCurrentCUDAStream(device.index()).stream(), err, sizeof(err));
  MG_CHECK(status == marlin_convert::MARLIN_OK, "marlin_gemm: %s", err);
  return C;
}

int64_t required_workspace_ints(int64_t n) { return marlin_convert::marlin_required_workspace_ints((int)n); }

int64_t pdl_launches() { return marlin_convert::marlin_pdl_launches(); }

std::string last_launch() {
  char buf[128];
  marlin_convert::marlin_last_launch(buf, sizeof buf);
  return std::string(buf);
}

#if defined(MARLIN_CONVERT_TRACE)
// Development builds: the int64 CUDA tensor [blocks, 16] the next launches stamp (scripts/trace_kernel.py); None stops.
// The tensor is held here until replaced, so the kernels never write into memory the allocator has handed on.
void trace_set(const c10::optional<torch::Tensor>& buffer) {
  static torch::Tensor held;
  if (!buffer.has_value()) {
    marlin_convert::marlin_trace_set(nullptr, 0);
    held = torch::Tensor();
    return;
  }
  const torch::Tensor& t = *buffer;
  MG_CHECK(t.is_cuda() && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == 16 && t.is_contiguous(),
           "trace_set: the buffer must be a contiguous int64 CUDA tensor [blocks, 16], got %s %s on %s",
           c10::toString(t.scalar_type()), Dims(t).text, c10::DeviceTypeName(t.device().type(), true).c_str());
  held = t;
  marlin_convert::marlin_trace_set(t.data_ptr(), (long)t.size(0));
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "marlin-convert's Marlin GEMM: fp16 / bf16 x 4 / 8-bit weights (see marlin_convert/kernel.py)";
  m.def("marlin_gemm", &marlin_gemm, "C = A[:, perm] @ dequant(B, s, zp)", py::arg("A"), py::arg("B"), py::arg("s"),
        py::arg("workspace"), py::arg("perm") = py::none(), py::arg("out") = py::none(), py::arg("split_k") = 0,
        py::arg("zp") = py::none(), py::arg("bits") = 4);
  m.def("required_workspace_ints", &required_workspace_ints, "(n / 64) * 16", py::arg("n"));
  m.def("pdl_launches", &pdl_launches, "launches made with programmatic dependent launch so far (tests)");
  m.def("last_launch", &last_launch, "the configuration of the last kernel this thread launched (tests)");
#if defined(MARLIN_CONVERT_TRACE)
  m.def("trace_set", &trace_set, "development builds: the buffer the kernels stamp", py::arg("buffer"));
#endif
}
