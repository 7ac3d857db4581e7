"""The DPO step against the formulas computed by hand, one answer at a time: sigmoid (with label smoothing),
IPO, SimPO; and the same pairs given in answer rows or packed rows give the same loss and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from launcher.preference import DPO
from launcher.preference import logps
from tests.float64 import in_float64

pytest.importorskip("transformers")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return in_float64(LlamaForCausalLM(config))


def _pairs():
    """(prompt, chosen, rejected) token lists of uneven lengths."""
    g = torch.Generator().manual_seed(1)
    out = []
    for p, c, r in ((3, 4, 2), (5, 1, 6), (2, 3, 3)):
        draw = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()  # noqa: E731
        out.append((draw(p), draw(c), draw(r)))
    return out


def _sequence(prompt, answer):
    return prompt + answer, [-100] * len(prompt) + answer


def _answer_logp(model, prompt, answer):
    """log p(answer | prompt), the answer's tokens one at a time (the model on this sequence alone)."""
    ids, _ = _sequence(prompt, answer)
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return sum(lp[len(prompt) + i - 1, t] for i, t in enumerate(answer)), len(answer)


def _padded(pairs, ref=None):
    rows, labels = [], []
    for p, c, r in pairs:
        for answer in (c, r):
            ids, lab = _sequence(p, answer)
            rows.append(ids)
            labels.append(lab)
    length = max(map(len, rows))
    batch = {"input_ids": torch.tensor([x + [0] * (length - len(x)) for x in rows]),
             "labels": torch.tensor([x + [-100] * (length - len(x)) for x in labels]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in rows])}
    batch["sequence_ids"] = torch.arange(len(rows)).unsqueeze(1).expand(-1, length).clone()
    batch["sequence_ids"][batch["attention_mask"] == 0] = -1
    if ref is not None:
        batch["ref_logps"] = ref
    return batch


def _packed(pairs, per_row=2):
    """The pairs packed per_row to a row: documents chosen, rejected, chosen, ..."""
    rows = []
    for start in range(0, len(pairs), per_row):
        row = {"input_ids": [], "labels": [], "position_ids": [], "document_ids": [], "sequence_ids": []}
        for j, (p, c, r) in enumerate(pairs[start:start + per_row]):
            for side, answer in enumerate((c, r)):
                ids, lab = _sequence(p, answer)
                row["input_ids"] += ids
                row["labels"] += [-100] + lab[1:]
                row["position_ids"] += list(range(len(ids)))
                row["document_ids"] += [2 * j + side] * len(ids)
                row["sequence_ids"] += [2 * (start + j) + side] * len(ids)
        rows.append(row)
    length = max(len(r["input_ids"]) for r in rows)
    pads = {"input_ids": 0, "labels": -100, "position_ids": 0, "document_ids": -1, "sequence_ids": -1}
    return {k: torch.tensor([r[k] + [v] * (length - len(r[k])) for r in rows]) for k, v in pads.items()}


def _by_hand(model, pairs, loss_type, beta, smoothing=0.0, gamma=0.5, ref=None):
    total = 0.0
    for k, (p, c, r) in enumerate(pairs):
        (lc, nc), (lr, nr) = _answer_logp(model, p, c), _answer_logp(model, p, r)
        rc, rr = ref[k] if ref else (0.0, 0.0)
        if loss_type == "sigmoid":
            z = beta * ((lc - rc) - (lr - rr))
            total = total - (1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        elif loss_type == "ipo":
            total = total + (((lc - rc) / nc - (lr - rr) / nr) - 1 / (2 * beta)) ** 2
        else:
            z = beta * (lc / nc - lr / nr) - gamma
            total = total - (1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    return total / len(pairs)


def _ref_tokens(batch, pairs, ref):
    """Per-token reference values whose sums per answer are `ref`: all of each answer's on its last token."""
    out = torch.zeros(batch["labels"].shape, dtype=torch.float64)
    for k in range(len(pairs)):
        for side in (0, 1):
            where = ((batch["sequence_ids"] == 2 * k + side) & (batch["labels"] != -100)).nonzero()
            out[tuple(where[-1])] = ref[k][side]
    return out


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("simpo", 0.1)])
def test_loss_is_the_formula(loss_type, smoothing):
    model, pairs = _model(), _pairs()
    ref = [(-9.5, -7.25), (-2.0, -11.0), (-6.5, -6.0)]
    step = DPO(beta=0.3, loss_type=loss_type, label_smoothing=smoothing)
    batch = _padded(pairs)
    batch["ref_logps"] = _ref_tokens(batch, pairs, ref)
    out = step(model, batch)
    expected = _by_hand(model, pairs, loss_type, 0.3, smoothing, ref=ref if loss_type != "simpo" else None)
    assert out["num_items"].item() == 3
    torch.testing.assert_close(out["loss"], expected.reshape(()), rtol=1e-12, atol=0)
    if loss_type == "sigmoid":
        rewards = out["output"]
        (lc, _), (lr, _) = _answer_logp(model, *pairs[0][:2]), _answer_logp(model, pairs[0][0], pairs[0][2])
        torch.testing.assert_close(rewards["rewards/chosen"][0], 0.3 * (lc - ref[0][0]), rtol=1e-12, atol=0)
        torch.testing.assert_close(rewards["logps/rejected"][0], lr, rtol=1e-12, atol=0)
        margins = rewards["rewards/chosen"] - rewards["rewards/rejected"]
        torch.testing.assert_close(rewards["rewards/margins"], margins)
        assert rewards["rewards/accuracies"].tolist() == (margins > 0).double().tolist()


def test_packed_rows_give_the_padded_rows_step():
    model, pairs = _model(), _pairs()
    ref = [(-9.5, -7.25), (-2.0, -11.0), (-6.5, -6.0)]
    losses, grads = [], []
    for batch in (_padded(pairs), _packed(pairs)):
        batch["ref_logps"] = _ref_tokens(batch, pairs, ref)
        model.zero_grad()
        out = DPO(beta=0.5)(model, batch)
        out["loss"].backward()
        held = out["output"]["logps/chosen"]
        assert int((~held.isnan()).sum()) == 3 and out["num_items"].item() == 3
        losses.append(out["loss"].detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-14)


def test_missing_reference_and_wrong_batches_are_one_line():
    from launcher.errors import UserError

    model, pairs = _model(), _pairs()
    with pytest.raises(UserError, match="needs the reference's log-probabilities"):
        DPO()(model, _padded(pairs))
    with pytest.raises(UserError, match="launcher.data.collate.Pairs"):
        DPO()(model, {"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    DPO(loss_type="simpo")(model, _padded(pairs))  # reference-free: none needed


@pytest.mark.parametrize("kwargs,says", [({"loss_type": "kto"}, "loss_type"), ({"beta": 0}, "beta"),
                                         ({"label_smoothing": 0.5}, "label_smoothing"), ({"beta": "x"}, "beta"),
                                         ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing")])
def test_bad_settings(kwargs, says):
    with pytest.raises(ValueError, match=says):
        DPO(**kwargs)


def test_per_token_values_are_log_softmax():
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, 4, -100, 1], [-100, -100, 6, 0, -100]])
    values = logps.per_token(logits, labels)
    lp = torch.log_softmax(logits, -1)
    assert values[0, 0] == 0 and values[0, 3] == 0 and values[1, 4] == 0
    assert math.isclose(values[0, 1].item(), lp[0, 0, 3].item(), rel_tol=1e-14)
    assert math.isclose(values[1, 3].item(), lp[1, 2, 0].item(), rel_tol=1e-14)


class _Logits(torch.nn.Module):
    """Logits from an embedding: a model whose forward adds no op of its own to the step's."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(64, 64)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return self.table(input_ids)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_step_asks_the_host_nothing(layout):
    """No op whose output's size or value the host must wait for (boolean indexing, nonzero, item): each is a
    device-to-host sync a step on a GPU (DESIGN invariant 1), seen here on the CPU by the ops dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.waits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            indices = args[1] if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) else []
            if (func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                         torch.ops.aten._local_scalar_dense.default)
                    or any(i is not None and i.dtype == torch.bool for i in indices)):
                self.waits.append(str(func))
            return func(*args, **(kwargs or {}))

    pairs = _pairs()
    batch = _padded(pairs) if layout == "padded" else _packed(pairs)
    batch["ref_logps"] = torch.zeros(batch["labels"].shape, dtype=torch.float64)
    model = _Logits()
    with Ops() as ops:
        out = DPO()(model, batch)
        out["loss"].backward()
    assert ops.waits == []
    assert out["num_items"].item() == len(pairs)
