"""bench/profile_train_step.py sorts GPU kernels into categories by name: the names our kernels and
PyTorch's CUDA kernels carry land where the issue-17 report says they do."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from profile_train_step import category  # noqa: E402


@pytest.mark.parametrize("name, expected", [
    ("_attention_fwd_kernel", "attention"),  # ours (kernels/attention.py)
    ("_attention_bwd_dkdv_kernel", "attention"),
    ("_dropout_mask_kernel", "other"),
    ("_add_layer_norm_bwd_kernel", "layernorm"),  # ours (kernels/add_layer_norm.py)
    ("_matmul_fwd_kernel", "gemm"),  # ours (kernels/matmul.py: the FFN's GEMMs, GELU fused)
    ("_matmul_dact_kernel", "gemm"),
    ("void scratchformer::cuda::(anonymous namespace)::embed_sinusoidal_bwd_kernel<float, 4, true>"
     "(int const*, int const*, float const*, float*, long, long, float, long)", "embedding"),  # csrc/cuda
    ("void scratchformer::cuda::(anonymous namespace)::embed_bwd_keys_kernel<long>"
     "(long const*, unsigned int*, int*, long, long, long)", "embedding"),
    ("void cub::CUB_300000_SM_900::detail::radix_sort::DeviceRadixSortOnesweepKernel<cub::CUB_300000_SM_900::"
     "detail::radix::policy_hub<unsigned int, int, int>::Policy900, false, unsigned int, int, int, int, int, "
     "cub::CUB_300000_SM_900::detail::identity_decomposer_t>", "embedding"),  # its ids' sort
    ("void at::native::(anonymous namespace)::krn_partials_per_segment<long>(long*, long const*, long, long)",
     "embedding"),  # F.embedding's backward
    ("void at::native::(anonymous namespace)::sum_and_scatter<c10::BFloat16, float, long>", "embedding"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4> >(Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "layernorm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
     "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, SoftMaxForwardEpilogue>",
     "attention"),  # the eager backend's attention softmax
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>", "loss"),
    ("void at::native::(anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 4>", "embedding"),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >", "other"),
])
def test_kernel_categories(name, expected):
    assert category(name) == expected
