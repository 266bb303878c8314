"""Generation speed per backend: KV-cached greedy and beam-4 decoding (issue 17).

The `base` preset at CNN/DailyMail shapes: batch 32, source 512 tokens (all real: decoding speed
is measured without padding's help), 128 new tokens per row. The model is untrained, so EOS is
switched off (an id that is never produced): every row decodes exactly 128 tokens and every backend
does the same work. Weights: bf16 (`model.to(torch.bfloat16)`), and, replayed from CUDA graphs,
also fp32 under bf16 autocast, as `evaluate` and `generate --precision bf16` run a checkpoint (the
weights cast once a call and lent, `model/weight_cast.py`: what that costs over bf16 weights). Reported in
extra_info: the weights' dtype and autocast's (none for bf16 weights), new tokens/s (batch x 128 /
time; beam search counts its best hypothesis only, not the beams) and peak memory. The
end-of-decoding check (a host sync) runs every `GPU_CHECK_EVERY` steps, the GPU default, passed
explicitly so the recorded interval is the one run.
Each case runs with launched steps (a launch per kernel) and with every decoding step replayed
from a CUDA graph (`cuda_graph=True`: static caches, the graph captured once per call, its warm-up
step and capture inside the timed call).
"""

import pytest
import torch
from conftest import requires_cuda, run_bench

from scratchformer.model import beam_search, build_model, get_config, greedy_decode
from scratchformer.model.decoding import GPU_CHECK_EVERY

pytestmark = [pytest.mark.benchmark(group="generate"), requires_cuda]

BATCH, SRC_LEN, NEW_TOKENS, VOCAB = 32, 512, 128, 30522
NO_EOS = -1  # never generated: fixed-length decoding


@pytest.mark.parametrize("steps,weights", [("launched", "bf16"), ("graph", "bf16"), ("graph", "fp32-autocast")])
@pytest.mark.parametrize("search", ["greedy", "beam4"])
@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_generate(benchmark, kernel, search, steps, weights):
    torch.manual_seed(0)
    cfg = get_config("base", src_vocab_size=VOCAB, kernel=kernel)
    model = build_model(cfg, "cuda").eval()
    if weights == "bf16":
        model.to(torch.bfloat16)
    src = torch.randint(4, VOCAB, (BATCH, SRC_LEN), device="cuda")
    src_len = torch.full((BATCH,), SRC_LEN, device="cuda")

    kw = dict(max_len=NEW_TOKENS, eos_id=NO_EOS, check_every=GPU_CHECK_EVERY, cuda_graph=steps == "graph")

    def decode():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights != "bf16"):
            if search == "greedy":
                out = greedy_decode(model, src, src_len, **kw)
            else:
                out = beam_search(model, src, src_len, beam_size=4, **kw)
        assert out.shape == (BATCH, NEW_TOKENS), out.shape
        return out

    torch.cuda.reset_peak_memory_stats()
    # dtype: the weights' as they are (fp32 under autocast; every case said "bf16" until 2026-12-01)
    median = run_bench(benchmark, decode, warmup=1, rounds=3, graph=False, preset="base",
                       dtype=next(model.parameters()).dtype, autocast=None if weights == "bf16" else torch.bfloat16,
                       batch=BATCH, src_len=SRC_LEN, new_tokens=NEW_TOKENS, search=search,
                       check_every=GPU_CHECK_EVERY, steps=steps, weights=weights)
    benchmark.extra_info.update(kernel=kernel, new_tokens_per_s=BATCH * NEW_TOKENS / median,
                                peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)
