"""`procckpt k8s`: golden files, YAML that parses, and only real fields of a batch/v1 Job.

The field lists below were written from the Kubernetes API reference (batch/v1 Job, JobSpec,
PodFailurePolicy; core/v1 ObjectMeta, PodTemplateSpec, PodSpec, Container, ...), as of
Kubernetes 1.30. A field procckpt emits that is not listed here fails the test: the API server's
strict field validation (kubectl's default since 1.27) would reject it the same way.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from procckpt.cli import main
from procckpt.errors import EX_TEMPFAIL, UsageError
from procckpt.schedulers.k8s import EXIT_MARGIN, K8sJobSpec, job_manifest, render_manifest

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parent / "golden"

OBJECT_META = {"annotations", "creationTimestamp", "deletionGracePeriodSeconds",
               "deletionTimestamp", "finalizers", "generateName", "generation", "labels",
               "managedFields", "name", "namespace", "ownerReferences", "resourceVersion",
               "selfLink", "uid"}
JOB = {"apiVersion", "kind", "metadata", "spec", "status"}
JOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "backoffLimitPerIndex", "completionMode",
            "completions", "managedBy", "manualSelector", "maxFailedIndexes", "parallelism",
            "podFailurePolicy", "podReplacementPolicy", "selector", "successPolicy", "suspend",
            "template", "ttlSecondsAfterFinished"}
POD_FAILURE_POLICY = {"rules"}
POD_FAILURE_POLICY_RULE = {"action", "onExitCodes", "onPodConditions"}
ON_EXIT_CODES = {"containerName", "operator", "values"}
ON_POD_CONDITIONS = {"status", "type"}
POD_TEMPLATE_SPEC = {"metadata", "spec"}
POD_SPEC = {"activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
            "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases",
            "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname", "imagePullSecrets",
            "initContainers", "nodeName", "nodeSelector", "os", "overhead", "preemptionPolicy",
            "priority", "priorityClassName", "readinessGates", "resourceClaims", "restartPolicy",
            "runtimeClassName", "schedulerName", "schedulingGates", "securityContext",
            "serviceAccount", "serviceAccountName", "setHostnameAsFQDN",
            "shareProcessNamespace", "subdomain", "terminationGracePeriodSeconds",
            "tolerations", "topologySpreadConstraints", "volumes"}
CONTAINER = {"args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
             "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy", "resources",
             "restartPolicy", "securityContext", "startupProbe", "stdin", "stdinOnce",
             "terminationMessagePath", "terminationMessagePolicy", "tty", "volumeDevices",
             "volumeMounts", "workingDir"}
ENV_VAR = {"name", "value", "valueFrom"}
ENV_VAR_SOURCE = {"configMapKeyRef", "fieldRef", "resourceFieldRef", "secretKeyRef"}
OBJECT_FIELD_SELECTOR = {"apiVersion", "fieldPath"}
RESOURCES = {"claims", "limits", "requests"}
VOLUME_MOUNT = {"mountPath", "mountPropagation", "name", "readOnly", "recursiveReadOnly",
                "subPath", "subPathExpr"}
# A Volume is its name plus exactly one source; only the sources procckpt uses are spelled out.
VOLUME = {"name", "persistentVolumeClaim", "emptyDir"}
PVC_SOURCE = {"claimName", "readOnly"}
EMPTY_DIR = {"medium", "sizeLimit"}

# (fields of this object, {field: schema of its value}); a list value's schema applies to items.
Schema = tuple[set[str], dict[str, Any]]
LEAF: Schema = (set(), {})
STRING_MAP = "string map"
SCHEMA: Schema = (JOB, {
    "metadata": (OBJECT_META, {"labels": STRING_MAP, "annotations": STRING_MAP}),
    "spec": (JOB_SPEC, {
        "podFailurePolicy": (POD_FAILURE_POLICY, {
            "rules": (POD_FAILURE_POLICY_RULE, {
                "onExitCodes": (ON_EXIT_CODES, {}),
                "onPodConditions": (ON_POD_CONDITIONS, {}),
            }),
        }),
        "template": (POD_TEMPLATE_SPEC, {
            "metadata": (OBJECT_META, {"labels": STRING_MAP}),
            "spec": (POD_SPEC, {
                "nodeSelector": STRING_MAP,
                "containers": (CONTAINER, {
                    "env": (ENV_VAR, {"valueFrom": (ENV_VAR_SOURCE, {
                        "fieldRef": (OBJECT_FIELD_SELECTOR, {})})}),
                    "resources": (RESOURCES, {"limits": "quantity map",
                                              "requests": "quantity map"}),
                    "volumeMounts": (VOLUME_MOUNT, {}),
                }),
                "volumes": (VOLUME, {"persistentVolumeClaim": (PVC_SOURCE, {}),
                                     "emptyDir": (EMPTY_DIR, {})}),
            }),
        }),
    }),
})
SERVICE = {"apiVersion", "kind", "metadata", "spec", "status"}
SERVICE_SPEC = {"allocateLoadBalancerNodePorts", "clusterIP", "clusterIPs", "externalIPs",
                "externalName", "externalTrafficPolicy", "healthCheckNodePort",
                "internalTrafficPolicy", "ipFamilies", "ipFamilyPolicy", "loadBalancerClass",
                "loadBalancerIP", "loadBalancerSourceRanges", "ports",
                "publishNotReadyAddresses", "selector", "sessionAffinity",
                "sessionAffinityConfig", "trafficDistribution", "type"}
SERVICE_SCHEMA: Schema = (SERVICE, {
    "metadata": (OBJECT_META, {"labels": STRING_MAP}),
    "spec": (SERVICE_SPEC, {"selector": STRING_MAP}),
})
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def unknown_fields(obj: Any, schema: Any, where: str = "") -> list[str]:
    """Paths of fields in ``obj`` that the schema does not know (or values of the wrong shape)."""
    if schema == STRING_MAP:
        return [f"{where}.{k}" for k, v in obj.items() if not isinstance(v, str)]
    if schema == "quantity map":
        return [f"{where}.{k}" for k, v in obj.items()
                if not (isinstance(v, int) or QUANTITY.match(str(v)))]
    if isinstance(obj, list):
        return [p for i, item in enumerate(obj) for p in unknown_fields(item, schema,
                                                                         f"{where}[{i}]")]
    if not isinstance(obj, dict):
        return []
    fields, children = schema
    bad = [f"{where}.{k}" for k in obj if k not in fields]
    for key, value in obj.items():
        if key in children:
            bad += unknown_fields(value, children[key], f"{where}.{key}")
        elif isinstance(value, dict) and key in fields:
            bad.append(f"{where}.{key} (a nested object this test has no field list for)")
    return bad


MINIMAL = K8sJobSpec(command=["python", "train.py"], image="registry.example/train:1",
                     pvc="ckpts")
FULL = K8sJobSpec(
    command=["torchrun", "--nproc-per-node", "8", "train.py", "--epochs", "90"],
    image="ghcr.io/example/train:1.0", pvc="shared-ckpts", name="resnet-90", namespace="ml",
    cpu="32", memory="256Gi", gpus=8, node_selector={"nvidia.com/gpu.product": "H100-SXM"},
    queue="team-a", grace=120.0, max_restarts=50, time_limit=None, env={"NCCL_DEBUG": "WARN"},
    shm="32Gi")

NODES = K8sJobSpec(
    command=["torchrun", "--nproc-per-node", "8", "train.py"], image="ghcr.io/example/train:1.0",
    pvc="shared-ckpts", name="gpt-4n", namespace="ml", gpus=8, grace=90.0, max_restarts=10,
    nodes=4, shm="32Gi")


@pytest.mark.parametrize("name,spec", [("k8s-minimal.yaml", MINIMAL), ("k8s-full.yaml", FULL),
                                       ("k8s-nodes.yaml", NODES)])
def test_manifest_matches_golden_file(name: str, spec: K8sJobSpec):
    text = render_manifest(spec)
    golden = GOLDEN / name
    if not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
        pytest.fail(f"{golden} did not exist and was written now: review it, commit it, rerun")
    expected = golden.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            str(golden), "procckpt k8s now"))
        pytest.fail(f"the manifest changed:\n{diff}\nDelete {golden} if this change is "
                    "intended (the next run writes it anew), then review and commit it.")


@pytest.mark.parametrize("spec", [MINIMAL, FULL, NODES])
def test_manifest_parses_and_names_only_real_job_fields(spec: K8sJobSpec):
    docs = list(yaml.safe_load_all(render_manifest(spec)))
    doc = docs[-1]
    assert doc["apiVersion"] == "batch/v1" and doc["kind"] == "Job"
    assert unknown_fields(doc, SCHEMA) == []
    if spec.nodes > 1:
        assert docs[0]["apiVersion"] == "v1" and docs[0]["kind"] == "Service"
        assert unknown_fields(docs[0], SERVICE_SCHEMA) == []
    else:
        assert len(docs) == 1


def test_several_nodes_get_an_indexed_job_whose_pods_find_node_0_by_name():
    service, job = yaml.safe_load_all(render_manifest(NODES))
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 4 * 10  # a restart ends all 4 pods with 75
    # The headless Service selects the pods, and names them NAME-K.SERVICE through subdomain.
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert pod["subdomain"] == service["metadata"]["name"]
    command = pod["containers"][0]["command"]
    launcher, user = command[:command.index("--")], command[command.index("--") + 1:]
    assert launcher[launcher.index("--nodes") + 1] == "4"
    assert launcher[launcher.index("--node-rank") + 1] == "$(NODE_RANK)"
    assert user[0] == "torchrun" and user[-3:] == ["--nproc-per-node", "8", "train.py"]
    assert "--nnodes=4" in user and "--node-rank=$(NODE_RANK)" in user
    assert f"--master-addr={job['metadata']['name']}-0.{service['metadata']['name']}" in user
    # $(NODE_RANK) is expanded by the kubelet from the container's env: the pod's index.
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_schema_check_catches_a_misspelt_field():
    doc = job_manifest(MINIMAL)
    doc["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    doc["spec"]["podFailurePolicy"]["rules"][0]["onPodCondition"] = []
    assert unknown_fields(doc, SCHEMA) == [
        ".spec.podFailurePolicy.rules[0].onPodCondition",
        ".spec.template.spec.terminationGracePeriod"]


def test_failure_policy_retries_checkpoints_ignores_preemption_and_fails_on_errors():
    spec = job_manifest(FULL)["spec"]
    pod = spec["template"]["spec"]
    # onExitCodes rules are only allowed with restartPolicy Never.
    assert pod["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == 50
    rules = spec["podFailurePolicy"]["rules"]
    # Kubernetes applies the first rule that matches: the preemption rule must come first, so a
    # preempted pod that checkpointed (exit 75) is not counted.
    assert rules[0] == {"action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "Count"
    assert rules[1]["onExitCodes"]["operator"] == "In"
    assert rules[1]["onExitCodes"]["values"] == [EX_TEMPFAIL]
    assert rules[2]["action"] == "FailJob"
    assert rules[2]["onExitCodes"] == {"containerName": "train", "operator": "NotIn",
                                       "values": [EX_TEMPFAIL]}
    names = {c["name"] for c in pod["containers"]}
    assert all(r["onExitCodes"]["containerName"] in names for r in rules[1:])
    assert pod["terminationGracePeriodSeconds"] == 120 + EXIT_MARGIN
    command = pod["containers"][0]["command"]
    assert command[:2] == ["procckpt", "run"]
    assert command[command.index("--grace") + 1] == "120s"
    assert command[command.index("--") + 1:] == FULL.command
    assert command[command.index("--dir") + 1].startswith(
        pod["containers"][0]["volumeMounts"][0]["mountPath"] + "/")


def test_kueue_label_gpus_node_selector_and_pvc():
    doc = job_manifest(FULL)
    assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert doc["spec"]["suspend"] is True
    pod = doc["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100-SXM"}
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 8
    assert res["requests"] == {"cpu": "32", "memory": "256Gi"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "shared-ckpts"}
    mounted = {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounted == set(volumes)
    minimal = job_manifest(MINIMAL)
    assert "kueue.x-k8s.io/queue-name" not in minimal["metadata"]["labels"]
    assert "suspend" not in minimal["spec"]


@pytest.mark.parametrize("change,message", [
    ({"name": "Train_1"}, "bad --name"),
    ({"pvc": "my_claim"}, "bad --pvc"),
    ({"memory": "lots"}, "bad --memory"),
    ({"dir": "/elsewhere/run"}, "outside --mount-path"),
    ({"queue": "team a"}, "bad --queue"),
    ({"node_selector": {"gpu": "a b"}}, "bad --node-selector gpu value"),
    ({"time_limit": 30.0}, "grace (60s) must be shorter than the time limit (30s)"),
    ({"command": []}, "no command given"),
    ({"nodes": 0}, "bad --nodes 0"),
    ({"nodes": 2}, "--nodes runs torchrun on every pod, but the command is 'python'"),
    ({"nodes": 2, "command": ["torchrun", "--nnodes=2", "t.py"]}, "drop --nnodes from"),
    ({"nodes": 2, "command": ["torchrun", "--standalone", "t.py"]}, "drop --standalone from"),
])
def test_bad_options_are_refused_with_what_to_do(change: dict, message: str):
    spec = K8sJobSpec(**{**MINIMAL.__dict__, **change})
    with pytest.raises(UsageError, match=re.escape(message)):
        job_manifest(spec)


def test_cli_prints_the_manifest_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]):
    assert main(["k8s", "--image", "registry.example/train:1", "--pvc", "ckpts", "--",
                 "python", "train.py"]) == 0
    assert capsys.readouterr().out == render_manifest(MINIMAL)
    assert main(["k8s", "--image", "x", "--pvc", "ckpts", "--node-selector", "novalue", "--",
                 "python", "t.py"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's command, as its API reference gives it:
    $(NAME) of a defined variable is replaced, $$ becomes $, anything else stays as written."""
    return re.sub(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_]*)\))",
                  lambda m: "$" if m.group(1) == "$" else env.get(m.group(2), m.group(0)), arg)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_multi_line_command_keeps_the_manifest_whole_and_the_command_verbatim(nodes: int):
    # bash -c with a newline is how many users write 'cd, then train'; the second one tries to
    # smuggle a top-level key into the Job through the header comment.
    script = "cd /code\nnamespace: injected #\npython train.py --tag '$(HOME)' $$ \u2028x"
    command = (["bash", "-c", script] if nodes == 1
               else ["torchrun", "--nproc-per-node=2", "train.py", "--note", script])
    out = subprocess.run([sys.executable, "-m", "procckpt", "k8s", "--image", "img:1", "--pvc",
                          "ckpts", "--nodes", str(nodes), "--", *command],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    documents = list(yaml.safe_load_all(out))
    job = documents[-1]
    assert [d["kind"] for d in documents] == (["Job"] if nodes == 1 else ["Service", "Job"])
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"}
    assert "namespace" not in job["metadata"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {"NODE_RANK": "1"}
    argv = [_kubelet_expand(arg, env) for arg in container["command"]]
    user = argv[argv.index("--") + 1:]
    if nodes == 1:
        assert user == command
    else:
        assert user[0] == "torchrun" and user[-4:] == command[-4:] and "--node-rank=1" in user
    # The header is one comment line that a shell turns back into the same words.
    header = out.splitlines()[0]
    assert header.startswith("# Generated by procckpt k8s for: ")
    words = subprocess.run(["bash", "-c", "printf '%s\\0' " +
                            header.removeprefix("# Generated by procckpt k8s for: ")],
                           capture_output=True, text=True, check=True).stdout
    assert words.split("\0")[:-1] == command


@pytest.mark.parametrize("name,nodes,message", [
    ("1train", 2, "bad --name '1train' with --nodes: it also names the headless Service, which "
                  "must start with a letter"),
    ("t" * 62, 2, f"--name {'t' * 62!r} is too long for --nodes 2: pod {'t' * 62 + '-1'!r} "
                  "would have a hostname over 63 characters; use at most 61 characters"),
    ("t" * 61, 12, "is too long for --nodes 12"),
])
def test_several_nodes_refuse_names_the_api_server_would_reject(name: str, nodes: int,
                                                                message: str):
    result = subprocess.run([sys.executable, "-m", "procckpt", "k8s", "--image", "img:1",
                             "--pvc", "ckpts", "--nodes", str(nodes), "--name", name, "--",
                             "torchrun", "train.py"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    # One node: a Job name that starts with a digit is fine, and so is 63 characters.
    assert main(["k8s", "--image", "i", "--pvc", "c", "--name", "1train", "--", "python",
                 "t.py"]) == 0


def test_the_grace_and_limits_come_from_the_environment_and_procckpt_yaml_as_for_run(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "procckpt.yaml").write_text("max-restarts: 7\ntime-limit: 2h\n")
    monkeypatch.setenv("PROCCKPT_GRACE", "90s")
    monkeypatch.setenv("PROCCKPT_INTERVAL", "5m")  # the pod's own to read: not refused here
    assert main(["k8s", "--image", "x", "--pvc", "ckpts", "--max-restarts", "3", "--",
                 "python", "train.py"]) == 0
    manifest = capsys.readouterr().out
    job = yaml.safe_load(manifest)
    assert job["spec"]["backoffLimit"] == 3  # the command line beats the file
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--time-limit") + 1] == "7200s", command
    assert command[command.index("--grace") + 1] == "90s", command
    monkeypatch.setenv("PROCCKPT_GRACE", "soon")
    assert main(["k8s", "--image", "x", "--pvc", "ckpts", "--", "python", "train.py"]) == 2
    assert "soon" in capsys.readouterr().err
