"""Sphinx configuration: the API reference (autodoc, NumPy-style docstrings) and the tutorials.

Build with ``make docs`` (warnings are errors). The notebooks are rendered from their saved
outputs; ``tests/docs/test_notebooks.py`` is what executes them.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

# brainstate / brainunit import-time notices are not ours to fix and would clutter the build log.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(brainstate|brainunit|saiunit|braintools|brainevent)(\.|$)")

import braintrace  # noqa: E402

project = "braintrace"
author = "braintrace developers"
copyright = "braintrace developers"
release = braintrace.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# -- autodoc / napoleon -------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"           # the docstrings state the types in NumPy style
autodoc_inherit_docstrings = False   # methods inherited from brainstate keep brainstate's docs there
autodoc_class_signature = "mixed"
autosummary_generate = False         # the tables point at objects documented on the same page

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True             # "Attributes" as fields: no second description of NamedTuple fields
napoleon_use_rtype = False
napoleon_use_param = True

# -- MyST / notebooks ---------------------------------------------------------------------------
nb_execution_mode = "off"            # notebooks are saved with outputs (docs/run_notebooks.py)
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# -- HTML ---------------------------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"braintrace {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Online learning of recurrent and spiking networks with eligibility traces",
    "page_width": "1100px",
    "sidebar_width": "240px",
}


# -- hooks --------------------------------------------------------------------------------------

_MULTI_NAME = re.compile(r"^(\s*)([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)+)\s*:\s*(.*)$")


def _split_multi_name_attributes(app, what, name, obj, options, lines):  # noqa: ANN001
    """Expand ``a, b : type`` entries of an ``Attributes`` section into one entry per name.

    NumPy style allows several names per entry; napoleon splits them in ``Parameters`` but not
    in ``Attributes`` (rendered as ``:ivar:`` fields, one name each). Runs before napoleon.
    """
    out: list[str] = []
    section = None
    section_indent = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and lines[i + 1].strip() and set(lines[i + 1].strip()) == {"-"}:
            section = line.strip()
            section_indent = line[: len(line) - len(line.lstrip())]
        match = _MULTI_NAME.match(line) if section == "Attributes" else None
        if match and match.group(1) == section_indent:
            indent, names, type_ = match.groups()
            body = []
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent + " ")):
                if not lines[j].strip() and (j + 1 >= len(lines) or not lines[j + 1].startswith(indent + " ")):
                    break
                body.append(lines[j])
                j += 1
            for each in (n.strip() for n in names.split(",")):
                out.append(f"{indent}{each} : {type_}")
                out.extend(body)
            i = j
            continue
        out.append(line)
        i += 1
    lines[:] = out


def _skip_namedtuple_field_aliases(app, what, name, obj, skip, options):  # noqa: ANN001
    """NamedTuple fields are described in the class's ``Attributes`` section already."""
    doc = getattr(obj, "__doc__", None)
    if isinstance(doc, str) and doc.startswith("Alias for field number"):
        return True
    return None


class _Shown:
    """A default value shown by a given text in a rendered signature."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _short_default(value):  # noqa: ANN001, ANN202
    if inspect.isclass(value):
        return _Shown(f"{value.__module__}.{value.__qualname__}")
    text = repr(value)
    if "\n" in text or len(text) > 60:
        # brainstate / braintools initialisers print over several lines (with their RNG state)
        return _Shown(f"{type(value).__name__}(...)")
    return value


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):  # noqa: ANN001
    """Constructor signatures of ``brainstate.nn.Module`` subclasses, with short defaults.

    brainstate's module metaclass defines ``__call__(cls, *args, **kwargs)``, which autodoc would
    otherwise report as the constructor signature; initialiser defaults print over several lines.
    """
    import brainstate

    if what not in ("class", "exception") or not inspect.isclass(obj):
        return None
    if not (issubclass(obj, brainstate.nn.Module) or signature == "(*args, **kwargs)"):
        return None
    try:
        sig = inspect.signature(obj.__init__)
    except (TypeError, ValueError):
        return None
    params = [
        p.replace(
            annotation=inspect.Parameter.empty,
            default=p.default if p.default is inspect.Parameter.empty else _short_default(p.default),
        )
        for p in list(sig.parameters.values())[1:]
    ]
    sig = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
    return str(sig), return_annotation


def setup(app):  # noqa: ANN001, ANN201
    app.connect("autodoc-process-docstring", _split_multi_name_attributes, priority=400)
    app.connect("autodoc-skip-member", _skip_namedtuple_field_aliases)
    app.connect("autodoc-process-signature", _constructor_signature)
