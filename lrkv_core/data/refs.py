"""One resolver for model and dataset references.

A model reference (:func:`resolve_model_dir`) is

- ``SCHEME:REST``: handled by the resolver registered for ``SCHEME`` (``builtin:pydoc-llama``, and later
  ``s3://bucket/model`` or ``models:/name/1`` from other packages);
- a local directory holding ``config.json``: a ref starting with ``.``, ``/`` or ``~`` is always a path,
  any other ref naming an existing path too;
- a hub id ``ORG/NAME`` (exactly one ``/``), downloaded with ``huggingface_hub.snapshot_download``.

A dataset spec (:func:`parse_dataset_spec`, :func:`resolve_spec`) is ``hf:NAME[:CONFIG[:SPLIT]]``,
``text:PATH``, ``parquet:PATH`` or ``SCHEME:REST`` from a plugin (lrkv_demo registers
``builtin:NAME:SPLIT``), each optionally followed by a percent slice ``[A%:B%]``
(:mod:`lrkv_core.data.slices`).

Schemes are pluggable: :func:`register_model_scheme` / :func:`register_dataset_scheme`, or an entry point
in the group ``lrkv.model_refs`` / ``lrkv.dataset_refs`` named after the scheme, loaded the first time that
scheme is met. lrkv_core never imports a plugin: it only reads entry points.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Generic, TypeVar

from .slices import PercentSlice, ends_like_slice, split_slice

MODEL_GROUP = "lrkv.model_refs"
DATASET_GROUP = "lrkv.dataset_refs"
CORE_KINDS = ("hf", "text", "parquet")
SPEC_FORMS = "hf:NAME[:CONFIG[:SPLIT]], text:PATH, parquet:PATH"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_SCHEME_REF = re.compile(r"([a-z][a-z0-9+.-]*):(.*)", re.DOTALL)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

ModelResolver = Callable[[str], "str | Path"]
R = TypeVar("R")


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed dataset spec; ``str(spec)`` gives back its canonical string form.

    ``kind`` is ``hf``, ``text``, ``parquet`` or a plugin scheme. ``name`` is the hub dataset name (hf), the
    file path (text, parquet) or everything after ``SCHEME:`` (plugin schemes). ``part`` is a percent
    slice of the source (tokens of a text stream, rows of a Parquet file); None means all of it.
    """

    kind: str
    name: str
    config: str | None = None
    split: str | None = None
    part: PercentSlice | None = None

    def __str__(self) -> str:
        if self.kind == "hf":
            head = f"hf:{self.name}:{self.config or ''}:{self.split}"
        else:
            head = f"{self.kind}:{self.name}"
        if self.part is not None:
            return head + str(self.part)
        return head + "[:]" if ends_like_slice(head) else head  # keeps a bracket-ending name a name

    @property
    def is_tokenized(self) -> bool:
        """True when the source holds token ids (one sequence per row) rather than text."""
        return self.kind == "parquet"

    @property
    def whole(self) -> DatasetSpec:
        """The same source without its slice."""
        return replace(self, part=None)


@dataclass(frozen=True)
class DatasetScheme:
    """What a plugin registers for a dataset scheme ``SCHEME:REST``.

    Attributes
    ----------
    form : str
        The accepted form, shown in messages (``"builtin:NAME:SPLIT"``).
    resolve : callable
        ``resolve(rest) -> DatasetSpec | str``: the ``hf:``/``text:``/``parquet:`` spec it stands for
        (unsliced). May build or download: it runs only when the data is read.
    check : callable, optional
        ``check(rest)``: a cheap syntax check that raises ValueError; runs whenever a spec is parsed.
    heldout : callable, optional
        ``heldout(rest) -> (eval_rest, description) | None``: the held-out evaluation data of calibration
        data ``rest`` (see :func:`lrkv_core.data.heldout.heldout`); None falls back to slicing the source.
    """

    form: str
    resolve: Callable[[str], DatasetSpec | str]
    check: Callable[[str], None] | None = None
    heldout: Callable[[str], tuple[str, str] | None] | None = None


class SchemeRegistry(Generic[R]):
    """Scheme name -> resolver for one kind of reference; unknown schemes are looked up in entry points."""

    def __init__(
        self, kind: str, group: str, coerce: Callable[[str, object], R], reserved: tuple[str, ...] = ()
    ) -> None:
        self.kind, self.group, self.reserved = kind, group, reserved
        self._coerce = coerce
        self._resolvers: dict[str, R] = {}

    def register(self, scheme: str, resolver: object) -> R:
        """Register ``resolver`` for ``scheme`` (registering an equal one again is a no-op)."""
        if not _SCHEME.fullmatch(scheme):
            raise ValueError(f"bad {self.kind} scheme {scheme!r}: lowercase letters, digits, '+', '-', '.'")
        if scheme in self.reserved:
            raise ValueError(f"{scheme!r} is a built-in {self.kind} kind, not a pluggable scheme")
        value = self._coerce(scheme, resolver)
        other = self._resolvers.get(scheme)
        if other is not None and other != value:
            raise ValueError(f"{self.kind} scheme {scheme!r} is already registered ({other!r})")
        self._resolvers[scheme] = value
        return value

    def unregister(self, scheme: str) -> None:
        """Forget ``scheme`` (its entry point, if any, is loaded again when it is next met)."""
        self._resolvers.pop(scheme, None)

    def loaded(self, scheme: str) -> R | None:
        """The resolver of ``scheme`` if it is registered already (never loads an entry point)."""
        return self._resolvers.get(scheme)

    def names(self) -> list[str]:
        """Registered schemes and those that entry points offer (without loading them)."""
        return sorted(set(self._resolvers) | {ep.name for ep in entry_points(group=self.group)})

    def get(self, scheme: str) -> R | None:
        """The resolver of ``scheme``, loading its entry point on first use; None if there is none."""
        if scheme in self._resolvers:
            return self._resolvers[scheme]
        ep = next(iter(entry_points(group=self.group, name=scheme)), None)
        return None if ep is None else self.register(scheme, ep.load())

    def require(self, scheme: str, ref: str) -> R:
        """:meth:`get`, or a ValueError naming the known schemes."""
        resolver = self.get(scheme)
        if resolver is None:
            known = ", ".join(self.names()) or "none"
            raise ValueError(f"unknown {self.kind} scheme {scheme!r} in {ref!r}; known schemes: {known}")
        return resolver


def _as_model_resolver(scheme: str, obj: object) -> ModelResolver:
    if not callable(obj):
        raise TypeError(f"model scheme {scheme!r}: a resolver must be callable(rest) -> path, got {obj!r}")
    return obj


def _as_dataset_scheme(scheme: str, obj: object) -> DatasetScheme:
    if isinstance(obj, DatasetScheme):
        return obj
    if callable(obj):
        return DatasetScheme(form=f"{scheme}:REST", resolve=obj)
    raise TypeError(f"dataset scheme {scheme!r}: expected a DatasetScheme or callable(rest), got {obj!r}")


MODEL_SCHEMES: SchemeRegistry[ModelResolver] = SchemeRegistry("model", MODEL_GROUP, _as_model_resolver)
DATASET_SCHEMES: SchemeRegistry[DatasetScheme] = SchemeRegistry(
    "dataset", DATASET_GROUP, _as_dataset_scheme, reserved=CORE_KINDS
)


def register_model_scheme(scheme: str, fn: ModelResolver) -> None:
    """Resolve model refs ``SCHEME:REST`` with ``fn(rest)``, which returns a local model directory."""
    MODEL_SCHEMES.register(scheme, fn)


def register_dataset_scheme(scheme: str, handler: DatasetScheme | Callable[[str], DatasetSpec | str]) -> None:
    """Resolve dataset specs ``SCHEME:REST`` with ``handler`` (a :class:`DatasetScheme` or its resolve)."""
    DATASET_SCHEMES.register(scheme, handler)


# ------------------------------------------------------------------------------------------------ models


def _model_dir(path: Path, ref: str) -> Path:
    """``path`` if it is a directory holding config.json, else a FileNotFoundError naming it."""
    if not path.exists():
        via = "" if str(path) == ref else f" (from {ref})"
        raise FileNotFoundError(f"model directory {path} does not exist{via}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory: a model is a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    return path


def _is_local_model(ref: str) -> bool:
    """Whether :func:`resolve_model_dir` reads ``ref`` as a local directory (not a scheme ref or a hub id)."""
    if _SCHEME_REF.fullmatch(ref):
        return False
    return ref.startswith((".", "/", "~")) or Path(ref).expanduser().exists()


def absolute_path(path: str) -> str:
    """``path`` with ``~`` expanded, made absolute against the current directory (symlinks kept)."""
    return os.path.abspath(os.path.expanduser(path))


def absolute_model_ref(ref: str) -> str:
    """``ref`` with a local directory made absolute (against the current directory); other forms as given.

    A task that runs in another process or on another host (a Dask worker) then reads the same directory.
    """
    return absolute_path(ref) if _is_local_model(ref) else ref


def resolve_model_dir(ref: str | Path) -> Path:
    """Local directory holding the model files of ``ref``, downloading or building them if needed.

    Parameters
    ----------
    ref : str or Path
        ``SCHEME:REST`` (a registered or entry-point scheme), a local directory, or a hub id ``ORG/NAME``
        (weights, configs and tokenizer files are downloaded). A ``Path`` is always a local directory.

    Returns
    -------
    Path
        A directory holding ``config.json``.

    Raises
    ------
    FileNotFoundError
        A missing directory, one without config.json, or a ref of none of the forms above.
    ValueError
        An unknown scheme; the message lists the known ones.
    """
    if isinstance(ref, Path):
        return _model_dir(ref.expanduser(), str(ref))
    m = _SCHEME_REF.fullmatch(ref)
    if m is not None:
        scheme, rest = m.groups()
        try:
            resolver = MODEL_SCHEMES.require(scheme, ref)
        except ValueError as err:
            raise ValueError(f"{err} (a local path? write ./{ref})") from None
        return _model_dir(Path(resolver(rest)).expanduser(), ref)
    path = Path(ref).expanduser()
    if _is_local_model(ref):
        return _model_dir(path, ref)
    if _HUB_ID.fullmatch(ref):
        from huggingface_hub import snapshot_download  # lazy: only hub ids need it

        return _model_dir(Path(snapshot_download(ref, allow_patterns=HUB_PATTERNS)), ref)
    known = ", ".join(MODEL_SCHEMES.names()) or "none"
    raise FileNotFoundError(
        f"model {ref!r} not found: not a local directory, a hub id ORG/NAME, or SCHEME:REST "
        f"(known schemes: {known})"
    )


# ---------------------------------------------------------------------------------------------- datasets


def accepted_forms() -> str:
    """The dataset spec forms this installation accepts (plugin schemes not yet loaded show as NAME:...)."""
    forms = [SPEC_FORMS]
    for name in DATASET_SCHEMES.names():
        loaded = DATASET_SCHEMES.loaded(name)
        forms.append(loaded.form if loaded is not None else f"{name}:...")
    return ", ".join(forms) + "; each optionally followed by a slice [A%:B%]"


def _bad_spec(spec: str, why: str = "") -> ValueError:
    why = f": {why}" if why else ""
    return ValueError(f"bad dataset spec {spec!r}{why}; accepted forms: {accepted_forms()}")


def parse_dataset_spec(spec: str | DatasetSpec) -> DatasetSpec:
    """Parse a dataset spec string (see the module docstring); a :class:`DatasetSpec` is returned as is.

    Parsing is cheap: it reads no data, downloads and builds nothing. A plugin scheme's ``check`` runs.

    Raises
    ------
    ValueError
        A malformed spec or slice, or an unknown scheme; the message lists the accepted forms.
    """
    if isinstance(spec, DatasetSpec):
        return spec
    text = str(spec)
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        raise _bad_spec(text)
    try:
        head, part = split_slice(rest, path=kind in ("text", "parquet"))
    except ValueError as err:
        raise _bad_spec(text, str(err)) from None
    if not head:
        raise _bad_spec(text)
    if kind in ("text", "parquet"):
        return DatasetSpec(kind=kind, name=head, part=part)  # a path may itself hold ':'
    if kind == "hf":
        parts = head.split(":")
        if len(parts) > 3 or not parts[0]:
            raise _bad_spec(text)
        config = parts[1] if len(parts) > 1 and parts[1] else None
        split = parts[2] if len(parts) > 2 and parts[2] else "train"
        return DatasetSpec(kind="hf", name=parts[0], config=config, split=split, part=part)
    scheme = DATASET_SCHEMES.get(kind) if _SCHEME.fullmatch(kind) else None
    if scheme is None:
        raise _bad_spec(text, f"unknown scheme {kind!r}")
    if scheme.check is not None:
        try:
            scheme.check(head)
        except ValueError as err:
            raise _bad_spec(text, str(err)) from None
    return DatasetSpec(kind=kind, name=head, part=part)


def absolute_dataset_spec(spec: str) -> str:
    """``spec`` with a relative ``text:``/``parquet:`` path made absolute (against the current directory),
    its slice kept; every other spec as given (see :func:`absolute_model_ref`)."""
    parsed = parse_dataset_spec(spec)
    if parsed.kind not in ("text", "parquet") or os.path.isabs(os.path.expanduser(parsed.name)):
        return spec
    return str(replace(parsed, name=absolute_path(parsed.name)))


def dataset_scheme(kind: str) -> DatasetScheme:
    """The :class:`DatasetScheme` of a plugin kind (loading its entry point on first use)."""
    return DATASET_SCHEMES.require(kind, f"{kind}:")


def resolve_spec(spec: str | DatasetSpec) -> DatasetSpec:
    """The ``hf:``/``text:``/``parquet:`` spec a spec stands for; plugin schemes resolve here.

    A plugin's resolver may build or download (``builtin:`` builds lrkv's demo model on first use); the
    spec's slice carries over to the spec it resolves to.
    """
    spec = parse_dataset_spec(spec)
    if spec.kind in CORE_KINDS:
        return spec
    out = parse_dataset_spec(dataset_scheme(spec.kind).resolve(spec.name))
    if out.kind not in CORE_KINDS:
        raise ValueError(f"the {spec.kind!r} scheme resolved {spec} to {out}, not one of {SPEC_FORMS}")
    if spec.part is None:
        return out
    if out.part is not None:
        raise ValueError(f"cannot slice {spec}: it resolves to the already sliced {out}")
    return replace(out, part=spec.part)
