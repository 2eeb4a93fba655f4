"""The offline tiny-Llama builder: saved config and tokenizer round-trip, idempotence."""

import hashlib
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvoffload.demo.tiny_model import (  # noqa: E402
    MARKER_FILE,
    build_tiny_llama,
    main,
)

SMALL = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One build shared by the read-only tests."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", **SMALL)


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_config_round_trip(tmp_path):
    from transformers import AutoConfig

    out = build_tiny_llama(tmp_path / "m", **SMALL, vocab_size=300, max_position_embeddings=1024)
    assert out == (tmp_path / "m").absolute()
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size) == (1, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.hidden_size // config.num_attention_heads == 32
    assert config.vocab_size == 300
    assert config.max_position_embeddings == 1024
    assert json.loads((out / MARKER_FILE).read_text())["dtype"] == "bfloat16"


def test_weights_load_and_are_deterministic(tmp_path, built):
    import torch
    from transformers import AutoModelForCausalLM

    again = build_tiny_llama(tmp_path / "again", **SMALL)
    other = build_tiny_llama(tmp_path / "other", **SMALL, seed=4)
    assert _digest(built) == _digest(again) != _digest(other)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 512)


def test_tokenizer_round_trip(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == 512
    text = "Hello, wörld!\n  tabs\tand ünïcode 漢字 " * 3
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no BOS
    assert ids[:5] == [3 + b for b in b"Hello"]
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    # every id the model can emit decodes to something
    assert tok.decode([511]) == "<|extra_252|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhi\n<|assistant|>\n"


def test_reuses_an_existing_build(tmp_path):
    out = build_tiny_llama(tmp_path / "m", **SMALL)
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_llama(tmp_path / "m", **SMALL) == out
    assert weights.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folders left


def test_rebuilds_when_arguments_change(tmp_path):
    out = build_tiny_llama(tmp_path / "m", **SMALL, seed=1)
    first = _digest(out)
    build_tiny_llama(tmp_path / "m", **SMALL, seed=2)
    assert _digest(out) != first
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_half_written_build_is_not_reused(tmp_path):
    out = build_tiny_llama(tmp_path / "m", **SMALL)
    (out / "model.safetensors").unlink()  # as if a copy was interrupted
    build_tiny_llama(tmp_path / "m", **SMALL)
    assert (out / "model.safetensors").is_file()


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a kvoffload tiny-model build"):
        build_tiny_llama(foreign, **SMALL)
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(hidden_size=64, num_heads=4), "head size"),  # 16: no CPU kernel
        (dict(hidden_size=96, num_heads=2), "head size"),  # 48
        (dict(num_heads=2, num_kv_heads=3), "num_kv_heads"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_rejects_bad_arguments(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_llama(tmp_path / "m", **{**SMALL, **bad})
    assert not (tmp_path / "m").exists()


def test_cli(tmp_path, capsys):
    args = [
        str(tmp_path / "m"),
        "--num-layers",
        "1",
        "--hidden-size",
        "64",
        "--num-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--intermediate-size",
        "128",
    ]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "m").absolute())
    assert main([str(tmp_path / "x"), "--hidden-size", "64", "--num-heads", "4"]) == 2
    assert "head size" in capsys.readouterr().err
