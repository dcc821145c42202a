"""A plain one-process SOAP, written from the published algorithm (Vyas et al. 2024, arXiv 2409.11321,
as the authors' reference implementation runs it), whole tensors and a loop over parameters, for the
tests to hold `vo.SOAP` against. Nothing of the library is used.

Per parameter, seen in its dimensions (`merge_dims`: neighbours multiplied while the product stays at
most `max_precond_dim`, a 4-D `channels_last` tensor merged from its channels-first order), every
dimension of at most `max_precond_dim` has a factor GG and a basis Q (1-D parameters only with
`precondition_1d`). The first step builds the factors and their eigenbases only; later steps run Adam
on the gradient rotated into the bases, rotate the direction back, step and decay, then take the
gradient into the factors and, every `precondition_frequency` Adam steps, refresh the bases by one
power iteration and a QR (sorted by estimated eigenvalue, the second moment permuted alike), carrying
the first moment into the new bases.

State per parameter, in the reference's layout: `step` (Adam steps), `exp_avg`, `exp_avg_sq` (rotated,
the parameter's shape), `GG` and `Q` (lists over the view's dimensions, `[]` where not rotated).
"""

from __future__ import annotations

import math

import torch

DEFAULTS = dict(
    lr=3e-3,
    betas=(0.95, 0.95),
    shampoo_beta=-1,
    eps=1e-8,
    weight_decay=0.01,
    precondition_frequency=10,
    max_precond_dim=10000,
    merge_dims=False,
    precondition_1d=False,
    normalize_grads=False,
    data_format="channels_first",
    correct_bias=True,
)


def merge(shape, limit):
    """The merged dimensions: a run of neighbours grows while its product stays within `limit`."""
    dims, current = [], 1
    for n in shape:
        if current * n > limit:
            dims.append(current if current > 1 else n)
            current = n if current > 1 else 1
        else:
            current *= n
    if current > 1 or not dims:
        dims.append(current)
    return dims


class View:
    """How the algorithm sees a parameter of `shape` under `group`'s options."""

    def __init__(self, shape, group):
        self.shape, limit = list(shape), group["max_precond_dim"]
        self.last = group["merge_dims"] and group["data_format"] == "channels_last" and len(shape) == 4
        if len(shape) == 1:
            self.dims = list(shape)
            self.rotated = [bool(group["precondition_1d"]) and shape[0] <= limit]
            return
        order = [shape[0], shape[3], shape[1], shape[2]] if self.last else list(shape)
        self.dims = merge(order, limit) if group["merge_dims"] else order
        self.rotated = [n <= limit for n in self.dims]

    def into(self, x):
        return (x.permute(0, 3, 1, 2) if self.last else x).reshape(self.dims)

    def out(self, y):
        if self.last:
            n, h, w, c = self.shape
            return y.reshape(n, c, h, w).permute(0, 2, 3, 1)
        return y.reshape(self.shape)


def along(x, k, matrix):
    """`x` with dimension k multiplied by `matrix` (`x_k <- matrix @ x_k`)."""
    return torch.movedim(torch.tensordot(matrix, x, dims=([1], [k])), 0, k)


def into_basis(x, bases):
    for k, q in enumerate(bases):
        if len(q):
            x = along(x, k, q.T)
    return x


def out_of_basis(x, bases):
    for k, q in enumerate(bases):
        if len(q):
            x = along(x, k, q)
    return x


def gram(x, k):
    """`X_(k) X_(k)ᵀ`: dimension k of `x` as rows, all the others as columns."""
    rows = torch.movedim(x, k, 0).reshape(x.shape[k], -1)
    return rows @ rows.T


class ReferenceSOAP(torch.optim.Optimizer):
    def __init__(self, params, **hyper):
        super().__init__(params, {**DEFAULTS, **hyper})

    @staticmethod
    def _eigenbasis(gg):
        try:
            vectors = torch.linalg.eigh(gg + 1e-30 * torch.eye(len(gg)))[1]
        except torch.linalg.LinAlgError:
            vectors = torch.linalg.eigh(gg.double() + 1e-30 * torch.eye(len(gg)))[1].float()
        return torch.flip(vectors, [1])

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
            for p in group["params"]:
                if p.grad is None:
                    continue
                view, state = View(p.shape, group), self.state[p]
                g = view.into(p.grad)
                if not state:  # the first step builds the preconditioner, nothing else
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    state["GG"] = [g.new_zeros(n, n) if r else [] for n, r in zip(view.dims, view.rotated)]
                    self._accumulate(state["GG"], g, shampoo_beta)
                    state["Q"] = [self._eigenbasis(gg) if len(gg) else [] for gg in state["GG"]]
                    continue
                state["step"] += 1
                t = state["step"]
                rotated = into_basis(g, state["Q"])
                m, v = view.into(state["exp_avg"]), view.into(state["exp_avg_sq"])
                m = beta1 * m + (1 - beta1) * rotated
                v = beta2 * v + (1 - beta2) * rotated * rotated
                update = view.out(out_of_basis(m / (v.sqrt() + group["eps"]), state["Q"]))
                if group["normalize_grads"]:
                    update = update / (1e-30 + update.pow(2).mean().sqrt())
                size = group["lr"]
                if group["correct_bias"]:
                    size = size * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.sub_(size * update)
                if group["weight_decay"] > 0:
                    p.sub_(group["lr"] * group["weight_decay"] * p)
                self._accumulate(state["GG"], g, shampoo_beta)
                if t % group["precondition_frequency"] == 0:
                    m = out_of_basis(m, state["Q"])
                    v = self._refresh(state, v)
                    m = into_basis(m, state["Q"])
                state["exp_avg"], state["exp_avg_sq"] = view.out(m), view.out(v)

    @staticmethod
    def _accumulate(factors, g, beta):
        for k, gg in enumerate(factors):
            if len(gg):
                gg.lerp_(gram(g, k), 1 - beta)

    @staticmethod
    def _refresh(state, v):
        """Each basis sorted by the estimated eigenvalues `diag(Qᵀ GG Q)`, `v` permuted alike, then
        one power iteration `GG Q` orthonormalised by QR."""
        for k, (gg, q) in enumerate(zip(state["GG"], state["Q"])):
            if not len(gg):
                continue
            order = torch.argsort(torch.diag(q.T @ gg @ q), descending=True)
            v = v.index_select(k, order)
            state["Q"][k] = torch.linalg.qr(gg @ q[:, order]).Q
        return v
