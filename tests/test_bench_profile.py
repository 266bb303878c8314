"""bench/profile_train_step.py sorts GPU kernels into categories by name: the names our kernels and
PyTorch's CUDA kernels carry land where the issue-17 report says they do."""

import os
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from profile_train_step import category, gpu_kernels, step_syncs  # noqa: E402


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
    # a review's finds (2026-11-28) in the H100 profile, sorted as "other" until then
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u, 256u, "
     "false>", "layernorm"),  # torch's LayerNorm weight and bias gradients
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>", "embedding"),  # F.embedding's forward
    ("_sum_partials_kernel", "layernorm"),  # ours (kernels/partial_sums.py): LayerNorm's dweight/dbias, mostly
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >", "other"),
])
def test_kernel_categories(name, expected):
    assert category(name) == expected


def _event(key, device_type, count=1, annotation=False):
    return SimpleNamespace(key=key, device_type=device_type, count=count, is_user_annotation=annotation)


def test_annotations_are_not_kernels_and_the_reports_sync_is_not_the_steps():
    """The GPU timeline's user annotations (the optimizer's range over its own kernels) are left out
    of the kernels, and the sync that closes the profile out of the steps' syncs."""
    events = [_event("Optimizer.step#AdamW.step", DeviceType.CUDA, annotation=True),
              _event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", DeviceType.CUDA, 7),
              _event("_attention_fwd_kernel", DeviceType.CUDA, 12),
              _event("cudaDeviceSynchronize", DeviceType.CPU), _event("cudaLaunchKernel", DeviceType.CPU, 500)]
    assert [e.key for e in gpu_kernels(events)] == ["multi_tensor_apply_kernel<FusedAdamMathFunctor>",
                                                   "_attention_fwd_kernel"]
    assert step_syncs(events, "cuda") == 0
    events.append(_event("cudaStreamSynchronize", DeviceType.CPU, 3))
    assert step_syncs(events, "cuda") == 3 and step_syncs(events, "cpu") == 4
