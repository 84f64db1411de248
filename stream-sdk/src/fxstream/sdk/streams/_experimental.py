"""Import ProxyStore's stream package without its ExperimentalWarning.

ProxyStore warns on import that streaming is experimental. fxstream pins the
ProxyStore version it tests against, and importing ``fxstream.sdk`` must not
warn every user, streams or not; the docs say the API is ProxyStore's.
"""

import warnings

from proxystore.warnings import ExperimentalWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", ExperimentalWarning)
    import proxystore.stream

__all__ = ["proxystore"]
