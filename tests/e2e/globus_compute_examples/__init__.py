"""Globus Compute's documentation examples, changed only where this package says.

Each script follows an example of Globus Compute's own documentation (its SDK guides of
2026: the quickstart, the Executor user guide, the Client user guide), section by
section, with two kinds of change only, each marked in the script:

* the import line (``globus_compute_sdk`` -> ``fxstream.sdk``) and the endpoint id
  (read from ``FXSTREAM_EXAMPLE_ENDPOINT``, where the documentation has a literal);
* ``# test:`` lines: a documentation typo that would not run as printed (named in the
  comment), a sleep scaled down so the suite does not wait hours, or a check added at
  the end so the script fails (non-zero exit) when the example's outcome is wrong.

``tests/e2e/test_globus_compute_examples.py`` runs each one as its own process, as a
user runs a script, against the session's shared platform (``Client()`` finds it
through ``FXSTREAM_HOME``, as after ``./fx up``).
"""
