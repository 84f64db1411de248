"""Resolve a pickled proxy at "the other site" (run as a subprocess by test_globus.py).

Usage: ``python -m tests.connectors.globus_site_reader <proxy.pickle> <out-file>``. The
process declares its site through ``FXSTREAM_GLOBUS_SITE`` (set by the test); the proxy
carries only the store's config, so the connector is rebuilt here for this site and the
object arrives by a (stand-in) Globus transfer. The resolved bytes go to ``out-file``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from proxystore.proxy import extract


def main(proxy_file: str, out_file: str) -> None:
    """Load the proxy, resolve it, write what it resolved to."""
    proxy = pickle.loads(Path(proxy_file).read_bytes())
    value = extract(proxy)  # resolving happens here, in this process
    Path(out_file).write_bytes(value)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
