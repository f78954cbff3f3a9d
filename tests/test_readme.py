"""The README's Python examples run as written, its test command is the one CI runs, and
it states evaluate.py's search defaults."""

import re
from pathlib import Path

import transformer

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


WORKDIR_EXAMPLE = 'load_run("runs/multi30k_en_de")'  # run by test_evaluate on a trained workdir


def readme_workdir_example() -> str:
    """The README's example of loading and translating with a workdir train.py wrote."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return next(block for block in blocks if WORKDIR_EXAMPLE in block)


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README has no Python example"
    namespace: dict = {}
    for block in blocks:  # later blocks build on earlier ones, as a reader runs them
        if WORKDIR_EXAMPLE not in block:
            exec(compile(block, "README.md", "exec"), namespace)


def test_the_public_names_the_readme_lists_are_the_packages():
    sentence = README.split("Every concept of the paper is a public name")[1].split(". ")[0]
    assert sorted(re.findall(r"`(\w+)`", sentence)[1:]) == sorted(transformer.__all__)
    assert all(hasattr(transformer, name) for name in transformer.__all__)


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in README


def test_readme_states_the_evaluation_defaults():
    import evaluate

    args = evaluate.parse_args(["--workdir", "w", "--split", "test2016"])
    example = next(line for line in README.splitlines() if "# last" in line)
    k = evaluate.DEFAULT_AVERAGE_LAST
    stated = f"last {k} averaged, beam {args.beam}, alpha {args.alpha:g}"
    assert example.endswith(stated), f"README says {example!r}, evaluate.py {stated!r}"


def test_readme_states_the_training_defaults():
    import train
    from transformer import TransformerConfig

    start = README.index("**Multi30k, default settings**")
    stated = " ".join(README[start : README.index("```", start)].split())
    t, d = train.TRAIN_DEFAULTS, train.DATA_DEFAULTS
    m = TransformerConfig.preset(train.DEFAULT_PRESET, vocab_size=d["vocab_size"])
    shape = {"linear": "linearly", "sqrt": "by 1 - sqrt(x)"}[t["cooldown_shape"]]
    for phrase in (
        f"`{train.DEFAULT_PRESET}` preset: d_model {m.d_model}, {m.num_heads} heads, "
        f"d_ff {m.d_ff}, {m.num_encoder_layers}+{m.num_decoder_layers} layers, "
        f"dropout {m.dropout_rate},",
        f"shared {d['vocab_size']}-piece {d['tokenizer_type'].upper()} vocabulary",
        f"{t['epochs']} epochs",
        f"at most {d['max_tokens']} padded tokens",
        f"warmup {t['warmup_steps']},",
        f"weight decay {t['weight_decay']:g}",
        f"{shape} to 0 over the last {round(t['cooldown'] * 100)}% of the steps",
        f"a checkpoint every {t['checkpoint_every']} steps",
    ):
        assert phrase in stated, f"the README's default settings do not say {phrase!r}"
    # The presets the README compares the default with, as the code has them.
    b, s = (TransformerConfig.preset(name, vocab_size=8000) for name in ("base", "small"))
    for phrase in (
        f"`base`: d {b.d_model}, {b.num_encoder_layers}+{b.num_decoder_layers} layers",
        f"`small` (d {s.d_model}, {s.num_encoder_layers}+{s.num_decoder_layers})",
    ):
        assert phrase in README, f"the README does not say {phrase!r}"
