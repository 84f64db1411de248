"""The ACL matrix on the session's single secure node (the cluster's: test_transport.py).

See :mod:`tests.security.acl_matrix`: every principal (admin, the service, two users, two
endpoints) tries every operation on every resource of one deployment, and the broker's
answer must be what the table in :mod:`fxstream.topics.acls` grants, cell by cell.
"""

from __future__ import annotations

import pytest

from ..conftest import RunningPlatform
from .acl_matrix import check_every_cell, deployment

pytestmark = pytest.mark.timeout(180)


def test_every_principal_gets_exactly_what_the_table_grants(
    kafka_platform: RunningPlatform,
) -> None:
    with deployment(kafka_platform.kafka) as matrix:
        check_every_cell(matrix)
