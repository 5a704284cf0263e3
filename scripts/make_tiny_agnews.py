"""Make the offline "tiny" assets for recipes/modernbert-ddp/ (no network, no downloads).

Writes to recipes/modernbert-ddp/tiny/ (or --out DIR):
  data/{train,val}.csv  1,600 / 400 rows of synthetic, class-balanced AG News look-alikes in the
                        original AG News CSV layout (no header; "class 1-4","title","description").
                        Each class has a ~30-word topic vocabulary, all share ~60 filler words plus
                        made-up names and numbers; ~30-40% of a field's words are topic words and a
                        few topic words of other classes are mixed in as noise.
  model/                a lowercase WordPiece tokenizer (~1k vocab) trained on the train texts, and
                        config.json for a 2-layer ModernBERT sequence classifier (no weights).

Deterministic (fixed seed; byte-identical output on every run). Regenerate with:
    python scripts/make_tiny_agnews.py
"""

import argparse
import csv
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    ModernBertConfig,
    PreTrainedTokenizerFast,
)

SEED = 1234
LABELS = ["World", "Sports", "Business", "Sci/Tech"]  # AG News class index = position + 1
CLASS_WORDS = [
    "treaty envoy border rebels summit embassy truce pact minister senate militia "
    "sanctions diplomat ballot coup protest regime troops asylum premier warlord exile allies "
    "junta peace army hostage monarch kremlin mandate",
    "coach striker league playoff season goal inning pitcher tennis golf marathon medal stadium "
    "rookie derby champion match referee halftime sprint wicket racket relay goalie dunk "
    "umpire defender squad olympic fixture",
    "shares profit earnings merger investor dividend stocks revenue retail bank loan fiscal "
    "takeover inflation tariff bonds lender ceo forecast payroll hedge fund nasdaq crude exports "
    "layoffs buyout margin audit rally",
    "software chip browser genome robot satellite laser server orbit comet virus spam linux "
    "wireless broadband pixel patch hacker database quantum rover fossil protein codec "
    "console modem wifi cipher iphone laptop",
]
FILLER = (
    "aides said week report new year plans group city monday tuesday friday early late major "
    "record after before amid over despite move deal news people state national local first second "
    "latest top big high sources memo today could would may due vowed noted told "
    "key concern plan push bid claim set face hit rise fall return cut boost long weekend "
    "agency again still"
).split()
CLASS_WORDS = [s.split() for s in CLASS_WORDS]
AGENCIES = ["Reuters", "AP", "AFP", "Wire"]


def words(rng, label, n, names):
    """n words: ~30-40% from the class vocabulary, rest shared filler, a little cross-class noise."""
    k = max(1, round(n * rng.uniform(0.30, 0.40)))
    out = [rng.choice(CLASS_WORDS[label]) for _ in range(k)]
    for _ in range(n - k):
        r = rng.random()
        if r < 0.08:  # noise: a topic word from another class
            out.append(rng.choice(CLASS_WORDS[rng.choice([c for c in range(4) if c != label])]))
        elif r < 0.18:
            out.append(rng.choice(names))
        elif r < 0.22:
            out.append(str(rng.choice([rng.randint(2, 99), rng.randint(1990, 2024)])))
        else:
            out.append(rng.choice(FILLER))
    rng.shuffle(out)
    return out


def make_row(rng, label, names):
    title = words(rng, label, rng.randint(4, 8), names)
    title = " ".join(w if w[0].isupper() else w.capitalize() for w in title)
    n = int(rng.triangular(12, 31, 12))  # 12-30 words, mostly short (keeps tiny/ small)
    desc = words(rng, label, n, names)
    if rng.random() < 0.15:  # quoted phrase, exercises CSV quote escaping
        i = rng.randrange(len(desc) - 1)
        desc[i], desc[i + 1] = '"' + desc[i], desc[i + 1] + '"'
    if n <= 27 and rng.random() < 0.2:  # AG News style dateline, "CITY (Agency) -"
        desc.insert(0, f"{rng.choice(names).upper()} ({rng.choice(AGENCIES)}) -")
    desc[len(desc) // 2] += ","
    desc = " ".join(desc)
    return [str(label + 1), title, desc[0].upper() + desc[1:] + "."]


def make_split(rng, n, names):
    labels = [i % 4 for i in range(n)]  # balanced classes, shuffled
    rng.shuffle(labels)
    return [make_row(rng, y, names) for y in labels]


def train_tokenizer(texts, vocab_size=1000):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

    def build(vocab):
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        return tok

    # The trainer creates "##x" tokens in hash-map order, which makes the vocabulary differ
    # between runs (huggingface/tokenizers#1794). Passing them in sorted order up front, then
    # rebuilding the tokenizer from the learned vocab (so they are plain tokens), fixes that.
    tok = build(None)
    norm, pre = tok.normalizer.normalize_str, tok.pre_tokenizer.pre_tokenize_str
    pieces = [w for t in texts for w, _ in pre(norm(t))]
    cont = sorted({"##" + c for w in pieces for c in w[1:]})
    tok.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials + cont, show_progress=False)
    )
    tok = build(tok.get_vocab())
    tok.add_special_tokens(specials)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        help="output folder (default: recipes/modernbert-ddp/tiny)",
        default=Path(__file__).resolve().parents[1] / "recipes/modernbert-ddp/tiny",
    )
    out = ap.parse_args().out

    rng = random.Random(SEED)
    syl = "ka ro vi ten mar lo su den bri ol ga tu ne sha pel or im zan ko ri".split()
    names = rng.sample(sorted((a + b).capitalize() for a in syl for b in syl if a != b), 120)  # made-up
    train, val = make_split(rng, 1600, names), make_split(rng, 400, names)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for split, rows in [("train", train), ("val", val)]:
        with open(out / f"data/{split}.csv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows(rows)

    tokenizer = train_tokenizer([f"{t} {d}" for _, t, d in train])
    tokenizer.save_pretrained(out / "model")

    config = ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        local_attention=16,
        global_attn_every_n_layers=2,
        pad_token_id=tokenizer.pad_token_id,
        cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        num_labels=4,
        id2label=dict(enumerate(LABELS)),
        label2id={l: i for i, l in enumerate(LABELS)},
    )
    config.save_pretrained(out / "model")

    # Smoke check: reload both from disk, build the model from config, run one forward pass.
    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(out / "model"))
    batch = tok([f"{t} {d}" for _, t, d in val[:8]], padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (8, 4), logits.shape
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {out}: {len(train)} train / {len(val)} val rows, vocab {len(tok)}, "
        f"{type(model).__name__} with {n_params:,} parameters, logits {tuple(logits.shape)}"
    )


if __name__ == "__main__":
    main()
