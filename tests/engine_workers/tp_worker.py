"""Tensor-parallel training on gloo ranks, each run compared with the same model trained on one rank.

``python tp_worker.py OUT WORLD SCENARIOS_JSON``: spawns WORLD ranks; each scenario (``{"name", "config", "tp",
"steps"}``) trains a small Hugging Face-style decoder (``self_attn.q_proj/k_proj/v_proj/o_proj``,
``mlp.gate_proj/up_proj/down_proj``) with ``torsh.initialize`` and the DeepSpeed loop. Every rank of one tensor-parallel
group reads the batch of its data-parallel index; rank 0 then trains the same model, from the same weights, on one
rank without any process group: on the concatenation of every data-parallel rank's batch (the mean of their means,
equal micro batches). Per rank, ``OUT/rankR.json`` holds the losses, the reference losses and the largest difference
between the final gathered weights and the reference's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name  # (a model file's own import)

VOCAB, HIDDEN, HEADS, SEQ, MICRO = 32, 16, 4, 6, 2


def build_model(seed: int = 0, tied: bool = False, kind: str = "tiny"):
    import torch
    from torch import nn

    if kind == "llama":  # a Hugging Face Llama with SDPA attention (grouped key/value heads, rotary positions)
        return _llama(seed)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            head = HIDDEN // HEADS  # the head count follows the (split) projection: view(..., -1, head_dim)
            q, k, v = (p(x).view(b, s, -1, head).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            if kind == "by_name":  # called through a module-level name bound to torch's function
                out = sdpa_by_name(q, k, v, is_causal=True)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
            self.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = nn.LayerNorm(HIDDEN)
            self.self_attn = Attention()
            self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class TinyDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.norm = nn.LayerNorm(HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, tokens, positions=None):  # (its attention is causal over the token order)
            x = self.embed_tokens(tokens)
            for layer in self.layers:  # "by_name": torch's reentrant checkpointing of each layer
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True) if kind == "by_name" else layer(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(seed)
    model = TinyDecoder()
    if tied:  # a Hugging Face causal LM's tie_word_embeddings
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _llama(seed: int):
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                 num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                 max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
            self.model = LlamaForCausalLM(config)

        def forward(self, tokens, positions):
            return self.model(input_ids=tokens, position_ids=positions).logits

    return Llama()


def batch(step: int, dp_rank: int, seq: int = SEQ):
    import torch

    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits, targets):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def run_scenario(rank: int, world: int, scenario: dict) -> dict:
    import torch

    import torsh

    tp, cp, steps, seq = scenario.get("tp", 1), scenario.get("cp", 1), scenario.get("steps", 4), scenario.get("seq", SEQ)
    dp = world // (tp * cp)
    dp_rank = rank // (tp * cp)  # the mesh is (dp..., cp, tp): tp innermost
    tied = scenario.get("tied", False)
    kind = scenario.get("model", "tiny")
    model = build_model(tied=tied, kind=kind)
    if scenario.get("hf_checkpointing"):  # transformers' own (reentrant) activation checkpointing
        model.model.gradient_checkpointing_enable({"use_reentrant": True})
        model.train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if scenario.get("tp_model_init"):  # DeepSpeed's AutoTP training entry, before initialize
        model = torsh.tp_model_init(model, tp_size=tp, dtype=torch.float32)
    data = torch.utils.data.TensorDataset(torch.arange(64)) if scenario.get("dataloader") else None
    engine, _, _, _ = torsh.initialize(model=model, config=scenario["config"], training_data=data)
    import torch.distributed as dist

    group = engine.data_parallel_group
    rec: dict = {"losses": [], "dp_world_size": dp, "train_batch_size": engine.train_batch_size(),
                 "engine_degrees": [engine.dp_world_size, engine.mp_world_size, engine.get_data_parallel_world_size(),
                                    engine.get_data_parallel_rank(), engine.get_tensor_parallel_rank(),
                                    dist.get_world_size(group), dist.get_rank(group)]}  # fmt: skip
    if data is not None:  # what the engine's dataloader gives this rank first
        rec["first_batch"] = next(iter(engine.training_dataloader))[0].tolist()
    outside = scenario.get("backward_outside", False)  # engine.backward after the context-parallel block
    for step in range(steps):
        if step == scenario.get("resume_at"):  # a checkpoint, and the rest of the run in a new engine loaded from it
            engine.save_checkpoint(scenario["save_dir"], tag="mid")
            engine, _, _, _ = torsh.initialize(model=build_model(seed=1, tied=tied, kind=kind), config=scenario["config"])
            engine.load_checkpoint(scenario["save_dir"], tag="mid")
        x, y = batch(step, dp_rank, seq)
        # each context-parallel rank trains on its part of the sequences (a no-op context without cp)
        positions = torch.arange(seq).expand(x.shape[0], seq).clone()  # the token places: split with the tokens
        with engine.context_parallel(buffers=[x, y, positions], no_restore_buffers={x, y, positions}):
            loss = lm_loss(engine(x, positions), y)
            if not outside:  # "direct": the script's own loss.backward() (ZeRO 1-3)
                loss.backward() if scenario.get("direct") else engine.backward(loss)
        if scenario.get("eval_between"):  # an evaluation forward of whole sequences before the backward
            with torch.no_grad():
                engine(*batch(step, dp_rank, seq)[:1], torch.arange(seq).expand(MICRO, seq))
        if outside:
            loss.backward() if scenario.get("direct") else engine.backward(loss)
        engine.step()
        rec["losses"].append(loss.item())
    rec["cp_shape"] = list(x.shape)
    params = dict(engine.module.named_parameters())
    if kind == "tiny":
        rec["tied"] = engine.module.lm_head.weight is engine.module.embed_tokens.weight
    rec["placements"] = {n: [str(pl) for pl in getattr(p, "placements", ())] for n, p in params.items()}
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in params.items()}
    if scenario.get("final_save"):  # the script's last line: a checkpoint saved on every rank
        engine.save_checkpoint(scenario["save_dir"], tag="final")
        dist.barrier()
    if rank == 0:
        clip, gas = scenario.get("clip", 0.0), scenario.get("gas", 1)
        ref = build_model(tied=tied, kind=kind)
        ref.load_state_dict(start, strict=False)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        rec["reference"] = []
        for step in range(steps):
            xs, ys = zip(*(batch(step, d, seq) for d in range(dp)))
            whole = torch.cat(xs)
            loss = lm_loss(ref(whole, torch.arange(seq).expand(whole.shape[0], seq)), torch.cat(ys))
            (loss / gas).backward()
            if (step + 1) % gas:  # gradient accumulation: the step at the boundary only
                rec["reference"].append(loss.item())
                continue
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            opt.zero_grad()
            rec["reference"].append(loss.item())
        expected = dict(ref.named_parameters())
        rec["weight_diff"] = max(float((full[n] - expected[n]).abs().max()) for n in expected)
        if scenario.get("final_save"):  # its weights, as DeepSpeed's zero_to_fp32 consolidates them
            from torsh.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            saved = get_fp32_state_dict_from_zero_checkpoint(scenario["save_dir"], tag="final")
            rec["saved_names"] = sorted(saved) == sorted(expected)
            rec["saved_diff"] = max(float((saved[n].float() - expected[n].detach()).abs().max()) for n in expected)
        rec["weight_scale"] = max(float(expected[n].abs().max()) for n in expected)
        rec["changed"] = max(float((full[n] - start[n]).abs().max()) for n in start)
    return rec


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests folder: the engine harness
    import _engine_harness

    out, world, scenarios = sys.argv[1], int(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    _engine_harness.spawn(scenarios, world, out, runner=run_scenario)


if __name__ == "__main__":
    main()
