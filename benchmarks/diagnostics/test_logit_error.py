"""logit_error.py on the tiny shape: asyncmoe's logits are as far from float32's as the unmodified bf16 model's."""

from logit_error import PROMPT, measure


def test_asyncmoe_errs_as_the_unmodified_model_does():
    r = measure("tiny", 4, 6, "cpu")
    assert {name: t.shape for name, t in r["tokens"].items()} == dict.fromkeys(
        r["tokens"], (1, PROMPT + 6)
    )
    assert r["gap"].shape == (6,) and (r["gap"] >= 0).all()
    base, ours = r["error"]["unmodified"], r["error"]["asyncmoe"]
    assert 0 < base.max() < 0.05  # bf16 rounding against float32: some, and small
    assert ours.max() <= 2 * base.max()
