"""Tokenizer and chat template: loading a checkpoint's `tokenizer.json` / `tokenizer_config.json`, and training
the small byte-level BPE tokenizer that generated checkpoints ship (from a corpus bundled with the project)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD, NOISE = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>", "<｜dspark_noise｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, NOISE, USER, ASSISTANT]  # ids 0..5 in generated tokenizers
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def train_tokenizer(vocab_size: int) -> HFTokenizer:
    """A deterministic byte-level BPE over the bundled corpus, special tokens first."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = CORPUS.read_text().splitlines()
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    tok = train_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
           "add_bos_token": False, "model_max_length": 65536, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


class Tokenizer:
    """Encode, decode and render chats for one checkpoint."""

    def __init__(self, checkpoint_dir: str | Path):
        d = Path(checkpoint_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} not found: a checkpoint directory holds {name}")
        self._tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        self.bos_token, self.eos_token = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        template = cfg.get("chat_template") or CHAT_TEMPLATE
        self._template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-level BPE token may hold part of a UTF-8 character)."""
        text = self._tok.id_to_token(token_id)
        if text is None:
            return b""
        if self._tok.token_to_id(text) is not None and text in self._special:
            return text.encode()
        table = _byte_level_table()
        if all(c in table for c in text):
            return bytes(table[c] for c in text)
        return self.decode([token_id]).encode()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: character -> the byte it encodes (the GPT-2 scheme: printable Latin-1
    bytes stand for themselves, the others map to code points from 256 up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_text(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, decoding only a short window of recent tokens.

    The window starts at the previous read point; a delta is the window's text beyond the text of its already
    returned part. That is exact for any decoder whose output for a token depends only on the tokens before it
    within the window, including those that treat a sequence's first token specially (SentencePiece's leading
    space): the first token of the window has already been returned. Decoding the whole list on every token made
    streaming quadratic in the output length. Text ending in U+FFFD (a character split across tokens, or invalid
    bytes) is held back until a later token completes it or `final`."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self._prefix = self._read = 0  # window start; end of the part already returned

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        done = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if text.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]

    @property
    def pending(self) -> str:
        """The held-back text (ending in U+FFFD), "" when there is none."""
        if self._read == len(self.ids):
            return ""
        done = self.tokenizer.decode(self.ids[self._prefix:self._read])
        return self.tokenizer.decode(self.ids[self._prefix:])[len(done):]
