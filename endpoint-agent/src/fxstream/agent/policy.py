"""What a (shared) endpoint agrees to run: allowed functions and argument serializers.

An endpoint's owner may list ``allowed_functions`` (function ids) and
``allowed_serializers`` (data strategies, e.g. only ``json``) in its ``config.yaml``. The
agent checks every task against them as it takes it off its queue, from the submission
record's fields and the arguments' 5-byte strategy header only
(:func:`~fxstream.topics.strategy_of`): a refused task's code is not even fetched and
nothing of it is deserialized. It is answered with a ``NotAllowedOnEndpoint`` error
(:attr:`~fxstream.topics.TaskErrorType.NOT_ALLOWED`, never retried) saying what the
endpoint allows and how its owner changes that.

A function registered with a container (``FunctionRecord.container``: an image's name,
or its ``"runtime:reference"``) runs only in that container: an image the endpoint allows
(``images``) runs it; any other is refused before it runs (:meth:`TaskPolicy.image_for`,
once the function's record is fetched; nothing of it is deserialized), with the ``images``
entry that would run it.

JSON-only arguments matter because every pickle-based strategy runs code while loading:
with ``allowed_serializers: [json]`` and a list of allowed functions, a user of the endpoint
can run only those functions, on plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from fxstream.agent.config import EndpointConfig
from fxstream.topics import DeserializationError, TaskSubmission, get_strategy, strategy_of

__all__ = ["TaskPolicy"]

# How many allowed function ids a refusal lists.
_LISTED: Final = 10


@dataclass(frozen=True)
class TaskPolicy:
    """The functions and argument strategies one endpoint runs (empty sets: any)."""

    endpoint: str
    functions: frozenset[str] = frozenset()
    serializers: frozenset[str] = frozenset()
    # The image the workers run in (None: no container), the images allowed (name ->
    # "runtime:reference") and the config file that lists them.
    image: str | None = None
    images: dict[str, str] = field(default_factory=dict)
    config_path: str = "config.yaml"

    @classmethod
    def of(cls, config: EndpointConfig) -> TaskPolicy:
        """The policy ``config`` sets."""
        return cls(
            endpoint=f"endpoint {config.name!r} ({config.endpoint_id})",
            functions=frozenset(config.allowed_functions),
            serializers=config.serializer_ids(),
            image=config.image if config.runtime != "process" else None,
            images=dict(config.images),
            config_path=str(config.path),
        )

    def image_for(self, function_id: str, container: str | None) -> tuple[str | None, str | None]:
        """Where function ``function_id``, registered with ``container`` (an image name or
        ``"runtime:reference"``), runs: ``(image name, None)``, with ``None`` for the
        endpoint's default; or ``(None, why it is refused)`` when the endpoint does not
        allow that container."""
        if container is None:
            return None, None
        by_spec = {spec: name for name, spec in self.images.items()}
        name = container if container in self.images else by_spec.get(container)
        if name is not None:
            return name, None
        runs_in = (
            f"its workers run in image {self.image!r} ({self.images.get(self.image, '')})"
            if self.image is not None
            else "its workers run in no container (runtime: process)"
        )
        allowed = ", ".join(sorted(self.images)) or "none"
        entry = (
            f"NAME: '{container}'" if ":" in container else f"{container}: '<runtime>:<reference>'"
        )
        return None, (
            f"function {function_id} runs only in container {container!r}, which "
            f"{self.endpoint} does not allow ({runs_in}; images allowed: {allowed}); refused "
            f"before it ran. To run it here, the endpoint's owner adds images: {{{entry}}} "
            f"to {self.config_path} and restarts the endpoint"
        )

    @property
    def open(self) -> bool:
        """True when the endpoint runs anything its users send."""
        return not self.functions and not self.serializers

    def refusal(self, submission: TaskSubmission) -> str | None:
        """Why this endpoint refuses ``submission``, or None to run it.

        Reads the record's fields and the arguments' header only; deserializes nothing.
        """
        if self.functions and submission.function_id not in self.functions:
            listed = sorted(self.functions)
            shown = ", ".join(listed[:_LISTED]) + (
                f" and {len(listed) - _LISTED} more" if len(listed) > _LISTED else ""
            )
            return (
                f"{self.endpoint} runs only the functions its owner allows ({shown}); "
                f"function {submission.function_id} is not one of them. Run one of those, or "
                f"ask the endpoint's owner to add {submission.function_id} to "
                "allowed_functions in the endpoint's config.yaml and restart the endpoint"
            )
        if not self.serializers:
            return None
        allowed = ", ".join(f"{get_strategy(i).name} ({i})" for i in sorted(self.serializers))
        # The arguments, and each parent's result a dependent task receives (issue 15).
        payloads = [("this task's arguments", submission.payload)]
        payloads += [
            (f"the result of parent task {parent}", value)
            for parent, value in submission.parent_results.items()
        ]
        for what, payload in payloads:
            try:
                strategy = strategy_of(payload)
            except DeserializationError as exc:
                return (
                    f"{self.endpoint} accepts arguments serialized with {allowed} only, and "
                    f"{what} do not say which serializer wrote them ({exc})"
                )
            if strategy.id in self.serializers:
                continue
            first = sorted(self.serializers)[0]
            return (
                f"{self.endpoint} accepts arguments serialized with {allowed} only; {what} "
                f"are {strategy.name} ({strategy.id}), refused unread. Submit with "
                f"Client(serializer=fxstream.topics.Serializer(data={first!r})), or ask the "
                f"endpoint's owner to add {strategy.id!r} to allowed_serializers in the "
                "endpoint's config.yaml and restart the endpoint"
            )
        return None
