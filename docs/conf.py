"""Sphinx configuration of pipe's docs site (`make docs`: warnings are errors).

Sphinx with MyST Markdown, because the guides pipe's presets encode are written that way
(NeMo Gym's rollout-tuning pages are Sphinx + MyST, OpenRLHF's guide is Sphinx + reST): the
same directives and cross-references, and pages that still read as plain Markdown on GitHub.
MkDocs Material was the other choice; Sphinx's `-W` turns every broken link, missing anchor,
orphan page and bad include into an error, which `make docs` relies on. README.md stays the
short front door;
BENCHMARKS.md stays at the repository root and is included by benchmarks.md.
"""

from __future__ import annotations

project = "pipe"
author = "pipe developers"
copyright = "pipe developers"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# every heading gets a GitHub-style anchor, so `page.md#a-heading` links work here and on
# GitHub alike (tests/unit/test_docs.py checks them with the same slug rule)
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence", "deflist"]

html_theme = "alabaster"
html_title = "pipe"
html_theme_options = {"description": "a declarative YAML pipeline engine for LLM post-training"}
