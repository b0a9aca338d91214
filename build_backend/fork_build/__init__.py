"""In-tree PEP 517/660 backend that builds the fork as the `sglang` distribution.

upstream wheel (pinned by upstream.lock, sha256-checked) -> patches/series applied
with `git am` in a private repo -> python/sglang/ overlaid -> wheel `sglang
<version>+<local>`. Standard library only; every failure raises BuildError naming
its culprit.
"""


class BuildError(RuntimeError):
    """A build input is wrong; the message names the file, patch or tag at fault."""
