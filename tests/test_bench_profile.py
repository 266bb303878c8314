"""bench/profile_train_step.py sorts GPU kernels into categories by name: the names our kernels and
PyTorch's CUDA kernels carry land where the issue-17 report says they do."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import profile_train_step  # noqa: E402
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


def _event(key, device_type, count=1, annotation=False, gpu_us=0.0, cpu_us=0.0):
    return SimpleNamespace(key=key, device_type=device_type, count=count, is_user_annotation=annotation,
                           self_device_time_total=gpu_us, self_cpu_time_total=cpu_us)


def _op(name, shapes, kernels, cpu_us=0.0, annotation=False):
    """A profiled CPU op as `profile().events()` gives it: its input shapes and the kernels it launched."""
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, is_user_annotation=annotation, input_shapes=shapes,
                           self_cpu_time_total=cpu_us,
                           kernels=[SimpleNamespace(name=k, duration=t) for k, t in kernels])


def test_the_ffn_is_told_apart_by_its_ops_d_ff_sized_inputs():
    """The issue asks for the FFN's share, which kernel names cannot give (its GEMMs are cuBLAS's or our
    matmul's, like the projections'): the gemm and other kernels of every op with an input of a d_ff-sized
    dim (its weights, hidden activations and their gradients, nested in a list of tensors too) move to
    it, forward and backward; an optimizer's kernel over every weight, or an annotation, does not; on a
    CPU the ops' self time moves."""
    gemm, relu = "sm90_xmma_gemm_bf16bf16_bf16f32", "void at::native::vectorized_elementwise_kernel<4, relu>"
    events = [_op("aten::addmm", [[4096, 256], [1024, 256], [1024]], [(gemm, 5.0)], cpu_us=50.0),
              _op("aten::threshold_backward", [[4096, 1024], [4096, 1024], []], [(relu, 2.0)], cpu_us=20.0),
              _op("aten::mm", [[4096, 256], [256, 768]], [(gemm, 7.0)], cpu_us=70.0),  # a projection's
              _op("aten::_foreach_add_", [[[1024, 256], [256]], []], [("multi_tensor_apply_kernel<Adam>", 3.0)]),
              _op("Optimizer.step#AdamW.step", [[1024]], [(gemm, 11.0)], annotation=True),
              SimpleNamespace(name=gemm, device_type=DeviceType.CUDA, is_user_annotation=False,
                              input_shapes=[[1024]], kernels=[], self_cpu_time_total=0.0)]
    assert profile_train_step.ffn_moves(events, 1024, "cuda") == {"gemm": 5.0, "other": 2.0}
    assert profile_train_step.ffn_moves(events, 1024, "cpu") == {"gemm": 50.0, "other": 20.0}
    assert profile_train_step.ffn_moves(events, 2048, "cuda") == {}


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


def test_a_profile_reports_per_step_figures(monkeypatch):
    """The report's arithmetic, on a stand-in profile of 3 steps (microseconds in all) whose kernels
    are, in this order: AdamW 1,500, a GEMM 3,000, attention's backward 3,000 and forward 4,500 (6
    calls), 12,000 in all; 4 syncs, 2 stream synchronizes and 2 blocking copies (the report's own one
    of them), and 300 launches of 1,500 in all; 30 ms of wall time over the 3 unprofiled steps. Per
    step, worked by hand: 4 ms of kernels, (4 - 1) / 3 = 1 sync, attention (4,500 + 3,000) / 12,000 =
    62.5% ahead of the GEMM's 25% and AdamW's 12.5%, the forward first among the kernels at 1.5 ms and
    6 / 3 = 2 calls, 100 launches (0.5 ms); a 10 ms step whose GPU works 4 ms idles 60% of it. The GEMM's
    1,200 launched by an op with a d_ff-sized input is the FFN's: 10%, the GEMM's 15%."""
    events = [_event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", DeviceType.CUDA, 3, gpu_us=1500.0),
              _event("sm90_xmma_gemm_bf16bf16", DeviceType.CUDA, 3, gpu_us=3000.0),
              _event("_attention_bwd_dkdv_kernel", DeviceType.CUDA, 3, gpu_us=3000.0),
              _event("_attention_fwd_kernel", DeviceType.CUDA, 6, gpu_us=4500.0),
              _event("cudaStreamSynchronize", DeviceType.CPU, 2, cpu_us=20.0),
              _event("cudaMemcpy", DeviceType.CPU, 2, cpu_us=10.0),
              _event("cudaLaunchKernel", DeviceType.CPU, 300, cpu_us=1500.0)]

    # 1,200 of the GEMM's 3,000 is the FFN's: launched by an op with an input of base's d_ff (2048)
    ops = [_op("aten::addmm", [[8192, 512], [512, 2048], []], [("sm90_xmma_gemm_bf16bf16", 1200.0)]),
           _op("aten::addmm", [[8192, 512], [512, 1536]], [("sm90_xmma_gemm_bf16bf16", 1800.0)])]

    class Profile:  # torch.profiler.profile's stand-in: its events, whatever ran under it
        def __init__(self, activities, record_shapes=False):
            assert record_shapes

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events

        def events(self):
            return ops

    steps = []
    monkeypatch.setitem(sys.modules, "bench_train_step", SimpleNamespace(
        training_step=lambda shape, kernel, device: (lambda: steps.append(1), None),
        SHAPES={"base-cnndm": {"preset": "base"}}))
    monkeypatch.setattr(profile_train_step, "profile", Profile)
    clock = iter([100.0, 100.03])  # the unprofiled steps' start and end, seconds
    monkeypatch.setattr(profile_train_step, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    report = profile_train_step.profile_backend("triton", "base-cnndm", "cuda", steps=3, warmup=2).splitlines()
    assert len(steps) == 2 + 3 + 3  # warm-up, timed, profiled
    assert report[0].startswith("== triton: 4.00 ms of GPU kernels per step, 1 host-device syncs per step")
    assert report[1] == "share by category: attention 62.5%, gemm 15.0%, optimizer 12.5%, ffn 10.0%"
    assert report[3].split() == ["1.500", "37.5%", "2", "attention", "_attention_fwd_kernel"]
    assert report[4].split()[:3] == ["1.000", "25.0%", "1"]
    host = report.index(next(line for line in report if line.startswith("host:")))
    assert report[host].startswith("host: the step takes 10.00 ms of wall time unprofiled, the GPU kernels 4.00 ms: "
                                   "idle 60% of it")
    assert report[host + 2].split() == ["0.500", "100", "cudaLaunchKernel"]


def test_profiling_no_steps_is_refused(monkeypatch, capsys):
    """--steps 0 would report figures per step of nothing: refused before any backend is profiled."""
    def profile_backend(*args, **kwargs):
        raise AssertionError("a backend profiled")

    monkeypatch.setitem(sys.modules, "bench_train_step", SimpleNamespace(SHAPES={"base-cnndm": {}}))
    monkeypatch.setattr(profile_train_step, "profile_backend", profile_backend)
    with pytest.raises(SystemExit):
        profile_train_step.main(["--steps", "0", "--device", "cpu"])
    assert "--steps must be >= 1" in capsys.readouterr().err
