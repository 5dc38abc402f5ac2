"""``procckpt k8s``: options + command -> a ``batch/v1`` Job manifest (a pure function).

How the Job maps procckpt's contract onto Kubernetes:

    Kubernetes                                   procckpt
    -------------------------------------------  ----------------------------------------------
    pod termination (preemption, eviction,       SIGTERM to PID 1 = ``procckpt run``: checkpoint
    drain, Kueue suspending the workload):       now, stop the training, exit 75 (EX_TEMPFAIL)
    SIGTERM, then SIGKILL after
    terminationGracePeriodSeconds                = --grace (time the checkpoint may take)
                                                 + the launcher's exit margin
    podFailurePolicy, in order:
      DisruptionTarget condition -> Ignore       a preemption is not the run's fault: retried
                                                 without counting
      exit code 75 -> Count                      "checkpointed, retry": a new pod resumes; each
                                                 one counts against backoffLimit
      any other non-zero exit -> FailJob         a real error: no retries to burn
    backoffLimit                                 = --max-restarts, the restart budget
    restartPolicy: Never                         required by onExitCodes rules; also makes every
                                                 retry a new pod, scheduled anywhere
    PVC mounted at --mount-path                  the checkpoint dir survives the pod

With ``--nodes N`` (N > 1) the Job is Indexed, N pods at once, and a headless Service gives pod
K the name ``NAME-K.NAME``. Every pod runs ``procckpt run --nodes N --node-rank K`` around
``torchrun --nnodes N --node-rank K --master-addr NAME-0.NAME``: node 0's launcher leads the
cycles, the others follow them (launcher/follower.py), and a SIGTERM to any pod checkpoints every
node. Each restart then ends N pods with 75, so backoffLimit is N times --max-restarts. The
checkpoint dir's claim must be ReadWriteMany: every pod mounts it.

Because podFailurePolicy is set, Kubernetes starts a replacement pod only once the old one has
fully terminated (podReplacementPolicy defaults to Failed), so two pods never write the
checkpoint dir at once. ``procckpt run`` as PID 1 handles the signals it needs and reaps
orphaned processes (see pid1.py), so no init shim is needed in the image.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import EX_TEMPFAIL, UsageError
from ..launcher.config import DEFAULT_GRACE, RunConfig, check_grace

__all__ = ["K8sJobSpec", "job_manifest", "service_manifest", "render_manifest", "EXIT_MARGIN",
           "CONTAINER", "NODE_RANK_ENV"]

CONTAINER = "train"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Seconds past --grace before the kubelet's SIGKILL: after the checkpoint is confirmed the
#: launcher gives the command up to 15 s to exit (supervisor.EXIT_AFTER_CONFIRM), then stops it.
EXIT_MARGIN = 30
#: On several nodes: the pod's index in the Indexed Job, in the container's environment (the
#: command refers to it as $(NODE_RANK), which the kubelet expands).
NODE_RANK_ENV = "NODE_RANK"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
MASTER_PORT = 29500
#: torchrun options that --nodes sets; a command that sets them itself is refused.
_TORCHRUN_GROUP_OPTIONS = ("--nnodes", "--node-rank", "--node_rank", "--master-addr",
                           "--master_addr", "--master-port", "--master_port", "--rdzv-backend",
                           "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--standalone")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class K8sJobSpec:
    """What to run and where; durations in seconds."""

    command: list[str]
    image: str
    pvc: str
    name: str = "procckpt-train"
    namespace: str | None = None
    mount_path: str = "/checkpoints"
    dir: str | None = None  # default: <mount_path>/<name>
    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    queue: str | None = None
    grace: float = DEFAULT_GRACE
    max_restarts: int = RunConfig.max_restarts
    time_limit: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    shm: str | None = None
    nodes: int = 1

    @property
    def checkpoint_dir(self) -> str:
        return self.dir or f"{self.mount_path.rstrip('/')}/{self.name}"

    def validate(self) -> None:  # noqa: C901 (one independent check per field)
        """Raise UsageError for what the API server would reject, with what to do instead."""
        if not self.command:
            raise UsageError("no command given: put it after --, e.g. procckpt k8s --image IMG "
                             "--pvc CLAIM -- python train.py")
        if not self.image.strip():
            raise UsageError("--image is empty: give the container image that has procckpt "
                             "and your training code")
        if len(self.name) > 63 or not _DNS_LABEL.match(self.name):
            raise UsageError(f"bad --name {self.name!r}: use at most 63 lower-case letters, "
                             "digits and '-', starting and ending with a letter or digit")
        if self.namespace is not None and (len(self.namespace) > 63
                                           or not _DNS_LABEL.match(self.namespace)):
            raise UsageError(f"bad --namespace {self.namespace!r}: lower-case letters, digits "
                             "and '-', at most 63")
        if len(self.pvc) > 253 or not _DNS_SUBDOMAIN.match(self.pvc):
            raise UsageError(f"bad --pvc {self.pvc!r}: the name of a PersistentVolumeClaim "
                             "(lower-case letters, digits, '-' and '.')")
        for path, what in ((self.mount_path, "--mount-path"), (self.checkpoint_dir, "--dir")):
            if not path.startswith("/"):
                raise UsageError(f"bad {what} {path!r}: must be an absolute path in the pod")
        mount = self.mount_path.rstrip("/") + "/"
        if not (self.checkpoint_dir.rstrip("/") + "/").startswith(mount):
            raise UsageError(f"--dir {self.checkpoint_dir} is outside --mount-path "
                             f"{self.mount_path}: checkpoints would be lost with the pod")
        for value, what in ((self.cpu, "--cpu"), (self.memory, "--memory"), (self.shm, "--shm")):
            if value is not None and not _QUANTITY.match(value):
                raise UsageError(f"bad {what} {value!r}: a Kubernetes quantity like 4, 500m, "
                                 "16Gi")
        if self.gpus < 0:
            raise UsageError(f"bad --gpus {self.gpus}: must be 0 or more")
        check_label_key(self.gpu_resource, "--gpu-resource")
        for key, value in self.node_selector.items():
            check_label_key(key, "--node-selector")
            check_label_value(value, f"--node-selector {key}")
        if self.queue is not None:
            check_label_value(self.queue, "--queue")
            if not self.queue:
                raise UsageError("--queue is empty: give the name of a Kueue LocalQueue")
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise UsageError(f"bad --env name {key!r}: letters, digits and '_'")
        check_grace(self.grace, self.time_limit)
        if self.max_restarts < 0:
            raise UsageError("--max-restarts must be 0 or more")
        if self.nodes < 1:
            raise UsageError(f"bad --nodes {self.nodes}: must be 1 or more")
        if self.nodes > 1:
            check_group_command(self.command)
            check_group_name(self.name, self.nodes)


def check_label_key(key: str, what: str) -> None:
    prefix, _, name = key.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) \
            or len(name) > 63 or not _LABEL_KEY_NAME.match(name):
        raise UsageError(f"bad {what} key {key!r}: [prefix/]name, name at most 63 letters, "
                         "digits, '-', '_' or '.'")


def check_label_value(value: str, what: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise UsageError(f"bad {what} value {value!r}: at most 63 letters, digits, '-', '_' or "
                         "'.', starting and ending with a letter or digit")


def check_group_name(name: str, nodes: int) -> None:
    """--nodes names a headless Service NAME and pods NAME-0 .. NAME-(N-1): the Service's name
    is a DNS-1035 label (it starts with a letter) and each pod's hostname is at most 63."""
    if not name[:1].isalpha():
        raise UsageError(f"bad --name {name!r} with --nodes: it also names the headless "
                         "Service, which must start with a letter (e.g. --name "
                         f"train-{name})")
    longest = f"{name}-{nodes - 1}"
    if len(longest) > 63:
        raise UsageError(f"--name {name!r} is too long for --nodes {nodes}: pod {longest!r} "
                         f"would have a hostname over 63 characters; use at most "
                         f"{63 - len(str(nodes - 1)) - 1} characters")


def check_group_command(command: list[str]) -> None:
    """--nodes starts torchrun on every pod and sets its group options itself."""
    if not command or command[0].rsplit("/", 1)[-1] != "torchrun":
        raise UsageError(f"--nodes runs torchrun on every pod, but the command is {command[0]!r}"
                         if command else "no command given")
    for arg in command[1:]:
        name = arg.split("=", 1)[0]
        if name in _TORCHRUN_GROUP_OPTIONS:
            raise UsageError(f"drop {name} from the torchrun command: with --nodes, procckpt k8s "
                             "sets the group options (--nnodes, --node-rank, --master-addr) "
                             "itself")


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _kubelet_verbatim(arg: str) -> str:
    """The kubelet expands $(VAR) in a container's command and reduces $$ to $: doubling every
    $ makes it hand the user's argument to the launcher exactly as written."""
    return arg.replace("$", "$$")


def command_comment(command: list[str]) -> str:
    """The command as one shell line for a YAML comment: an argument holding a newline (or any
    other character YAML or a terminal takes as a line break) is written $'...' with escapes,
    so the comment stays one line and the manifest's structure is not cut."""
    return " ".join(shlex.quote(arg) if arg.isprintable()
                    else "$'" + "".join(_ansi_c_char(char) for char in arg) + "'"
                    for arg in command)


_ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _ansi_c_char(char: str) -> str:
    if char in _ANSI_C_ESCAPES:
        return _ANSI_C_ESCAPES[char]
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def inner_command(spec: K8sJobSpec) -> list[str]:
    """What the container runs: the launcher around the user's command (each of its $ doubled,
    so that the kubelet's $(VAR) expansion leaves it as written)."""
    argv = ["procckpt", "run", "--dir", spec.checkpoint_dir, "--grace", _seconds(spec.grace)]
    if spec.time_limit is not None:
        argv += ["--time-limit", _seconds(spec.time_limit)]
    command = [_kubelet_verbatim(arg) for arg in spec.command]
    if spec.nodes == 1:
        return [*argv, "--", *command]
    rank = f"$({NODE_RANK_ENV})"
    group = [f"--nnodes={spec.nodes}", f"--node-rank={rank}",
             f"--master-addr={spec.name}-0.{spec.name}", f"--master-port={MASTER_PORT}"]
    return [*argv, "--nodes", str(spec.nodes), "--node-rank", rank, "--",
            command[0], *group, *command[1:]]


def job_manifest(spec: K8sJobSpec) -> dict[str, Any]:
    """The Job as plain data (dicts, lists, str, int), fields in the API reference's order."""
    spec.validate()
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "procckpt"}
    job_labels = dict(labels)
    if spec.queue:
        job_labels[KUEUE_QUEUE_LABEL] = spec.queue
    metadata: dict[str, Any] = {"name": spec.name}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    metadata["labels"] = job_labels

    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = spec.memory
        limits["memory"] = spec.memory
    if spec.gpus:
        limits[spec.gpu_resource] = spec.gpus  # extended resources: limits (requests follow)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits

    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if spec.nodes > 1:
        env.append({"name": NODE_RANK_ENV,
                    "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}})
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    mounts: list[dict[str, Any]] = [{"name": "checkpoints", "mountPath": spec.mount_path}]
    volumes: list[dict[str, Any]] = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.pvc}}]
    if spec.shm:
        # DataLoader workers and NCCL pass tensors through /dev/shm; a container's default is
        # 64 MiB.
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm}})

    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": inner_command(spec),
        "env": env,
    }
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": math.ceil(spec.grace) + EXIT_MARGIN,
    }
    if spec.nodes > 1:
        pod_spec["subdomain"] = spec.name  # pod K resolves as NAME-K.NAME (the Service below)
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    pod_spec["containers"] = [container]
    pod_spec["volumes"] = volumes

    job_spec: dict[str, Any] = {
        "backoffLimit": spec.max_restarts * spec.nodes,  # each restart ends every pod with 75
        "completions": spec.nodes,
        "parallelism": spec.nodes,
    }
    if spec.nodes > 1:
        job_spec["completionMode"] = "Indexed"
    if spec.queue:
        job_spec["suspend"] = True  # Kueue admits (unsuspends) it when the queue has quota
    job_spec["podFailurePolicy"] = {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                            "values": [EX_TEMPFAIL]}},
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                                              "values": [EX_TEMPFAIL]}},
    ]}
    job_spec["template"] = {"metadata": {"labels": labels}, "spec": pod_spec}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec}


def service_manifest(spec: K8sJobSpec) -> dict[str, Any]:
    """The headless Service that gives each pod of a --nodes Job its DNS name; its addresses
    are published before the pods are ready, since torchrun needs them to become so."""
    metadata: dict[str, Any] = {"name": spec.name}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    metadata["labels"] = {"app.kubernetes.io/name": spec.name,
                          "app.kubernetes.io/managed-by": "procckpt"}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/name": spec.name}}}


def render_manifest(spec: K8sJobSpec) -> str:
    """The manifest as YAML, with a header saying how it was made and how to use it."""
    manifest = job_manifest(spec)
    body = yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False, width=100)
    if spec.nodes > 1:
        body = yaml.safe_dump(service_manifest(spec), sort_keys=False,
                              default_flow_style=False, width=100) + "---\n" + body
    header = (
        f"# Generated by procckpt k8s for: {command_comment(spec.command)}\n"
        f"# SIGTERM -> checkpoint within {spec.grace:g}s -> exit {EX_TEMPFAIL} -> a new pod "
        f"resumes (at most {spec.max_restarts} times); preemptions do not count.\n"
        f"# kubectl apply -f THIS_FILE; procckpt status {spec.checkpoint_dir} (in a pod with "
        "the claim mounted)\n"
    )
    if spec.nodes > 1:
        header += (f"# {spec.nodes} pods, one per node, share the claim {spec.pvc}: it must be "
                   "ReadWriteMany. Pod 0 leads; a SIGTERM to any pod checkpoints them all.\n")
    return header + body
