"""The undocumented Flower entry points fedsurv's warm ClientApp executor uses, and nothing else.

Flower's documented API has no way to serve a SuperNode's tasks from a long-lived process, so
:mod:`flwr_app.executor` uses what Flower's own ``flower-superexec`` and ``flwr-clientapp`` are made
of. This is the only product module that imports them; ``tests/test_executor.py`` fails on a Flower
whose version is not in :data:`TESTED_FLOWER_VERSIONS` or whose entry points lost a name or changed a
signature. Each entry point is used as Flower's own command uses it (file in Flower 1.41.0 and 1.42.0):

* :func:`run_clientapp` (``flwr/supernode/runtime/run_clientapp.py``): what ``flwr-clientapp``
  runs for one task: pulls the task's message, context and app bundle with the task's token,
  runs the ClientApp, pushes the reply and the task's output, sends the task's heartbeat, and
  ends with ``flwr_exit`` (``SystemExit``);
* :func:`runtime_client` (``flwr/supercore/superexec/run_superexec.py``): the SuperNode's Runtime
  API client that ``flower-superexec`` claims tasks with (``AcquireTask``), without its tracing;
* :func:`acquire_clientapp_task`: one ``AcquireTask`` call for a ClientApp task: the task's ID and
  its token, or None.
"""

from __future__ import annotations

from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import run_clientapp

#: The Flower releases the executor was run against (its unit test and the loopback deployment).
TESTED_FLOWER_VERSIONS = ("1.41.0", "1.42.0")

#: The entry points' signatures as tested (``tests/test_executor.py`` compares them with the installed Flower).
SIGNATURES = {
    "flwr.supernode.runtime.run_clientapp.run_clientapp":
        "(runtime_api_address: str, token: str, insecure: bool, certificates: bytes | None = None, "
        "parent_pid: int | None = None, runtime_dependency_install: bool = False) -> None",
    "flwr.supercore.runtime.RuntimeHttpClient.from_server_address":
        "(server_address: 'str', insecure: 'bool', root_certificates: 'bytes | str | None', "
        "interceptors: 'Sequence[ProtobufClientInterceptor]', *, retry_invoker: 'RetryInvoker | None' = None) "
        "-> 'Self'",
    "flwr.supercore.interceptors.RuntimeVersionHttpInterceptor": "(component_name: str) -> None",
    "flwr.supercore.retry.make_simple_http_retry_invoker": "() -> flwr.supercore.retry.retry_invoker.RetryInvoker",
    "flwr.supercore.tls.validate_and_resolve_root_certificates":
        "(root_cert_path: str | None, insecure: bool) -> bytes | None",
}

__all__ = ["SIGNATURES", "TESTED_FLOWER_VERSIONS", "acquire_clientapp_task", "root_certificates", "run_clientapp",
           "runtime_client"]


def root_certificates(path: str | None, insecure: bool) -> bytes | None:
    """The PEM bytes of ``path`` for a TLS Runtime API (None with ``insecure``), checked as Flower checks them."""
    return validate_and_resolve_root_certificates(path, insecure)


def runtime_client(address: str, *, insecure: bool, certificates: bytes | None) -> RuntimeHttpClient:
    """A client of the SuperNode's Runtime API at ``address`` identifying itself as Flower's SuperExec does."""
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker())


def acquire_clientapp_task(client: RuntimeHttpClient) -> tuple[int, str] | None:
    """Claim one pending ClientApp task of the SuperNode: ``(task_id, token)``, or None when there is none."""
    response = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
    if response.HasField("task") and response.token:
        return response.task.task_id, response.token
    return None
