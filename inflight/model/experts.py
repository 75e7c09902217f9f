"""A layer's MLP as routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, gpt-oss,
GLM-4.5, ERNIE 4.5): a router scores every expert for each token, the token goes through its
`top_k` best (by the scores plus a bias for the choice, GLM-4.5's and ERNIE 4.5's; within its
best groups of experts, DeepSeek's), and their
outputs are summed weighted by the router's softmax over the experts (renormalized over the chosen
ones where the model says so: gpt-oss's softmax over the chosen scores is that) or by their
sigmoids (GLM-4.5's). Qwen2-MoE adds a shared expert every token runs, its output scaled by the
sigmoid of a one-row matmul of the token (GLM-4.5's and ERNIE 4.5's, unscaled). The activation of
each expert's gate/up output is the caller's (gpt-oss's clamped SwiGLU).

The step's tokens are grouped by expert, so each expert runs one matmul over all the tokens that
chose it, never one per token: a decode step of 64 requests with 8 of 128 experts each reads
each chosen expert's weights once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from inflight.model.linear import Linear


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid, each element the same whatever the tensor's size: PyTorch's vector loop and
    the scalar one after it (the last elements of a size not a multiple of the vector) round some
    values a unit apart, so a token's routing weights changed with the tokens beside it (8 experts:
    1 token in 9; a shared expert's gate of one column: any step of 17 tokens or more). Computed in
    fp64, either loop's result rounds to the same fp32 value (but where it lies within 1e-16 of
    half an fp32 unit)."""
    return torch.sigmoid(x.double()).to(x.dtype)


class RoutedExperts:
    def __init__(self, router: Linear | None, gate_up: Sequence[Linear], down: Sequence[Linear], top_k: int,
                 normalize: bool, shared: tuple[Linear, Linear, Linear | None] | None = None,
                 scoring: str = "softmax", choice_bias: torch.Tensor | None = None, scale: float = 1.0,
                 groups: tuple[int, int] = (1, 1), sparsemixer_eps: float = 0.0) -> None:
        """`gate_up[e]` and `down[e]`: expert e's fused gate/up and down matmuls. Without a
        `router`, the one expert is a dense MLP (a layer of a MoE model that has no experts).
        `shared`: a shared expert's gate/up and down matmuls and its gate (one output; None: its
        output added as it is). `scoring` ("softmax", "sigmoid", "sparsemixer"), `choice_bias` and
        `scale`: as `ModelConfig.expert_scoring`, its bias for the choice, `routed_scaling`;
        `groups` and `sparsemixer_eps`: as `ModelConfig.expert_groups` and `sparsemixer_eps`."""
        if len(gate_up) != len(down) or not gate_up or (router is None and len(gate_up) != 1):
            raise ValueError("one gate/up and one down matmul per expert, and a router unless there is one")
        if shared is not None and (router is None or (shared[2] is not None and shared[2].out_features != 1)):
            raise ValueError("a shared expert sits beside routed ones, gated by one output or not at all")
        if scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"experts scored by a softmax, by sigmoids or by a sparse mixer, not {scoring!r}")
        self.router, self.gate_up, self.down = router, list(gate_up), list(down)
        self.top_k, self.normalize, self.shared = top_k, normalize, shared
        self.scoring, self.choice_bias, self.scale = scoring, choice_bias, scale
        self.groups = groups
        self.sparsemixer_eps = sparsemixer_eps

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def __call__(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The MLP's output for the rows of `x` `[tokens, hidden]`; `act` is the activation and
        gating of a gate/up matmul's output (`TokenOps.silu_and_mul`)."""
        if self.router is None:
            return self.down[0](act(self.gate_up[0](x)))
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # one token: its experts in id order, the same sums as grouping them below
            for expert, weight in sorted(zip(chosen[0].tolist(), weights[0].tolist(), strict=True)):
                out += self.down[expert](act(self.gate_up[expert](x))) * weight
            return self._with_shared(x, out, act)
        # Every (token, choice) pair, sorted by expert: each expert's tokens are one slice.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows_of = order // self.top_k
        pair_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count == 0:
                continue
            pairs = order[start:start + count]
            rows = rows_of[start:start + count]
            start += count
            y = self.down[expert](act(self.gate_up[expert](x.index_select(0, rows))))
            out.index_add_(0, rows, y * pair_weights.index_select(0, pairs).unsqueeze(1))
        return self._with_shared(x, out, act)

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor,
                     act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`out` (the routed experts' sum) plus the shared expert's output, where there is one."""
        if self.shared is not None:
            gate_up, down, gate = self.shared
            shared = down(act(gate_up(x)))
            out += shared if gate is None else row_sigmoid(gate(x)) * shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's `top_k` experts `[tokens, top_k]` (best first) and their weights, in `x`'s
        dtype: the softmax over all experts in fp32, renormalized over the chosen where
        `normalize`; or each expert's sigmoid, the chosen sigmoids renormalized where `normalize`
        (GLM-4.5's); either way the choice by the scores plus `choice_bias` where there is one
        (GLM-4.5's, ERNIE 4.5's), within the token's best groups where `groups` says (DeepSeek's);
        times `scale`. Phi-3.5-MoE's sparse mixer: `sparsemixer`'s choice and weights."""
        assert self.router is not None
        logits = self.router(x).float()
        if self.scoring == "sparsemixer":
            weights, chosen = sparsemixer(logits, self.top_k, self.sparsemixer_eps)
            return weights.to(x.dtype), chosen
        scores = row_sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if self.choice_bias is None else scores + self.choice_bias
        if self.groups[0] > 1:
            choice = self._within_groups(choice)
        if choice is scores:
            weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        else:
            chosen = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, chosen)
        if self.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if self.scoring == "sigmoid" else total)
        if self.scale != 1:
            weights = weights * self.scale
        return weights.to(x.dtype), chosen

    def _within_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` `[tokens, experts]` with every expert outside the token's `kept` best groups at
        -inf: a group scored by its best expert (softmax scoring, DeepSeek-V2's) or its best two's
        sum (sigmoid scoring, V3's), as transformers' routers."""
        groups, kept = self.groups
        per_group = choice.view(choice.shape[0], groups, -1)
        best = per_group.amax(dim=-1) if self.scoring == "softmax" else per_group.topk(2, dim=-1).values.sum(dim=-1)
        mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, torch.topk(best, kept, dim=-1).indices, True)
        return choice.masked_fill(~mask.repeat_interleave(per_group.shape[2], dim=1), float("-inf"))


def sparsemixer(logits: torch.Tensor, top_k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's choice of experts at inference (its `sparsemixer`): the best expert by
    logit, weighted by the softmax over the experts whose logits lie within a relative 2 * eps of
    its own ((best - s) / max(|s|, best) <= 2 * eps); then, the chosen left out, the best of the
    rest, weighted alike (the closeness still measured on every logit). `[tokens, top_k]` weights
    (not renormalized) and experts, as transformers computes them."""
    weights, chosen = [], []
    left = logits
    for _ in range(top_k):
        best, index = left.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        weights.append(torch.softmax(left.masked_fill(far, float("-inf")), dim=-1).gather(1, index))
        chosen.append(index)
        left = left.scatter(1, index, float("-inf"))
    return torch.cat(weights, dim=1), torch.cat(chosen, dim=1)
