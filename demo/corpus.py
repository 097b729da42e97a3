"""The embedded model's corpus and tokenizer: the Python stdlib's docstrings, byte-level BPE.

Docstrings are read with ``ast`` from the source files (never imported: some stdlib modules have side
effects), so every Python install has this text and nothing is downloaded.
"""

from __future__ import annotations

import ast
import logging
import os
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"  # ids 0 and 1
DOC_SEPARATOR = "\n\n"
_SKIPPED = (
    "site-packages dist-packages test tests idlelib lib2to3 turtledemo ensurepip __pycache__ __phello__"
)
SKIP_DIRS = frozenset(_SKIPPED.split())
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def collect_stdlib_docstrings(root: Path | None = None, max_chars: int = 3_000_000) -> str:
    """Module, class and function docstrings of the standard library, parsed with ``ast`` (never imported).

    Parameters
    ----------
    root : Path, optional
        Source directory to walk; default ``sysconfig.get_paths()["stdlib"]``. Directories named in
        ``SKIP_DIRS`` (site-packages, tests, idlelib, ...) and hidden ones are skipped.
    max_chars : int
        Cap on the result: beyond it the text is cut at the last docstring boundary before ``max_chars``.

    Returns
    -------
    str
        Cleaned docstrings (``ast.get_docstring``) in sorted file order and source order within a file,
        exact duplicates dropped, joined with blank lines. Files that fail to parse are skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        files.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    docs: dict[str, None] = {}  # insertion-ordered set
    for rel_path in sorted(files):
        try:
            tree = ast.parse((root / rel_path).read_bytes(), filename=rel_path)
        except (SyntaxError, ValueError, OSError) as err:
            logger.debug("skipping %s: %s", rel_path, err)
            continue
        stack: list[ast.AST] = [tree]
        while stack:  # pre-order: a module's docstring, then its classes and their methods, in source order
            node = stack.pop()
            if isinstance(node, _DOC_NODES):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    docs.setdefault(doc.strip())
            stack.extend(reversed(list(ast.iter_child_nodes(node))))
    text = DOC_SEPARATOR.join(docs)
    if len(text) > max_chars:
        cut = text.rfind(DOC_SEPARATOR, 0, max_chars)
        text = text[: cut if cut > 0 else max_chars]
    return text


def split_corpus(text: str, valid_fraction: float) -> tuple[str, str]:
    """Split into (train, valid) at the docstring boundary before ``1 - valid_fraction`` of the text.

    The separator at the cut belongs to neither side, so ``text == train + DOC_SEPARATOR + valid``.
    """
    at = int(len(text) * (1.0 - valid_fraction))
    cut = text.rfind(DOC_SEPARATOR, 0, at)
    if cut <= 0:
        return text[:at], text[at:]
    return text[:cut], text[cut + len(DOC_SEPARATOR) :]


def train_tokenizer(train_text: str, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on ``train_text``: ``<|bos|>`` = 0, ``<|eos|>`` = 1, nothing added on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([train_text], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
