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

# pydata-sphinx-theme, which NeMo Gym's docs are built on (nvidia-sphinx-theme extends it):
# a fluid page, so the settings tables and the two-line commands get the window's width
# (Alabaster's fixed 940px column made both overflow); _static/pipe.css widens the article
# and lets a table wider still scroll inside its own box
html_theme = "pydata_sphinx_theme"
html_title = "pipe"
html_static_path = ["_static"]
html_css_files = ["pipe.css"]
templates_path = ["_templates"]
# every page sits in the root toctree, so the left column lists the whole site by caption
# (_templates/sidebar-global.html) and the top bar carries no page links of its own
html_sidebars = {"**": ["sidebar-global", "page-toc"]}
html_theme_options = {
    "navbar_center": [],
    "navbar_align": "left",
    "show_toc_level": 1,
    # the page's own contents sit under the site's in the left column: no right column, so
    # the article has the rest of the window
    "secondary_sidebar_items": [],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
