"""The cluster files parse, the RayJob passes a schema check of what `kubectl apply` would accept, and
the job they run points at a recipe that validates."""
import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from common import config as C

REPO = Path(__file__).resolve().parent.parent


def test_rayjob_runs_a_valid_recipe():
    job = yaml.safe_load((REPO / "cluster" / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob"
    words = job["spec"]["entrypoint"].split()
    recipe = words[words.index("--config") + 1]
    cfg = C.load(str(REPO / recipe))
    gpus = sum(g["replicas"]
               * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    # the cluster must hold the trainer's GPUs plus one per rollout replica
    assert gpus >= cfg.train.num_workers + cfg.rollout.replicas * cfg.rollout.gpus_per_replica


def test_runtime_env_parses():
    env = yaml.safe_load((REPO / "cluster" / "runtime_env.yaml").read_text())
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"


# ---------------------------------------------------------------- schema: what `kubectl apply` would accept
# A hand-written subset of the KubeRay CRD (ray.io/v1 RayJob) and of the core PodTemplate: field names
# (unknown ones are errors, as under kubectl's strict field validation), types, required fields, and
# resource quantities in Kubernetes' quantity syntax.
QUANTITY = {"anyOf": [{"type": "integer", "minimum": 0},
                      {"type": "string", "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                                                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}]}
DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
OBJ, STR, BOOL, INT0 = {"type": "object"}, {"type": "string"}, {"type": "boolean"}, {"type": "integer", "minimum": 0}
STRS = {"type": "array", "items": STR}
RESOURCES = {"type": "object", "additionalProperties": False, "properties": {
    "limits": {"type": "object", "additionalProperties": QUANTITY},
    "requests": {"type": "object", "additionalProperties": QUANTITY}, "claims": {"type": "array"}}}
CONTAINER = {"type": "object", "required": ["name", "image"], "additionalProperties": False, "properties": {
    "name": DNS_LABEL, "image": {"type": "string", "minLength": 1},
    "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "command": STRS, "args": STRS, "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "envFrom": {"type": "array"}, "resources": RESOURCES, "volumeMounts": {"type": "array", "items": {
        "type": "object", "required": ["name", "mountPath"]}},
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "additionalProperties": False,
                                         "properties": {
                                             "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                                             "name": DNS_LABEL, "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}},
    "securityContext": OBJ, "lifecycle": OBJ, "readinessProbe": OBJ, "livenessProbe": OBJ, "workingDir": STR}}
POD_TEMPLATE = {"type": "object", "required": ["spec"], "additionalProperties": False, "properties": {
    "metadata": OBJ, "spec": {"type": "object", "required": ["containers"], "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER}, "volumes": {"type": "array"},
        "nodeSelector": {"type": "object", "additionalProperties": STR}, "tolerations": {"type": "array"},
        "serviceAccountName": STR, "imagePullSecrets": {"type": "array"}}}}}
RAY_START_PARAMS = {"type": "object", "additionalProperties": STR}  # values must be strings ("0", not 0)
HEAD_GROUP = {"type": "object", "required": ["template"], "additionalProperties": False, "properties": {
    "rayStartParams": RAY_START_PARAMS, "template": POD_TEMPLATE, "serviceType": STR, "enableIngress": BOOL,
    "headService": OBJ, "labels": OBJ, "resources": OBJ}}
WORKER_GROUP = {"type": "object", "required": ["groupName", "template"], "additionalProperties": False, "properties": {
    "groupName": DNS_LABEL, "replicas": INT0, "minReplicas": INT0, "maxReplicas": INT0,
    "numOfHosts": {"type": "integer", "minimum": 1},
    "rayStartParams": RAY_START_PARAMS, "template": POD_TEMPLATE, "idleTimeoutSeconds": INT0, "suspend": BOOL,
    "labels": OBJ, "resources": OBJ, "scaleStrategy": OBJ}}
RAY_CLUSTER_SPEC = {"type": "object", "required": ["headGroupSpec"], "additionalProperties": False, "properties": {
    "rayVersion": STR, "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
    "enableInTreeAutoscaling": BOOL, "autoscalerOptions": OBJ, "headServiceAnnotations": OBJ, "suspend": BOOL,
    "gcsFaultToleranceOptions": OBJ, "managedBy": STR}}
RAYJOB = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
          "properties": {
              "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayJob"},
              # KubeRay derives the RayCluster's and the submitter's names from it: it refuses names over 47
              "metadata": {"type": "object", "required": ["name"], "properties": {
                  "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 47},
                  "namespace": DNS_LABEL, "labels": OBJ, "annotations": OBJ}},
              "spec": {"type": "object", "required": ["entrypoint", "rayClusterSpec"], "additionalProperties": False,
                       "properties": {
                           "entrypoint": {"type": "string", "minLength": 1}, "rayClusterSpec": RAY_CLUSTER_SPEC,
                           "runtimeEnvYAML": STR, "shutdownAfterJobFinishes": BOOL, "ttlSecondsAfterFinished": INT0,
                           "activeDeadlineSeconds": INT0, "backoffLimit": INT0, "suspend": BOOL, "jobId": STR,
                           "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                           "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": OBJ, "clusterSelector": OBJ,
                           "entrypointNumCpus": {"type": "number"}, "entrypointNumGpus": {"type": "number"},
                           "entrypointResources": STR, "metadata": OBJ, "deletionStrategy": OBJ, "managedBy": STR}}}}
RUNTIME_ENV_KEYS = {"env_vars", "excludes", "working_dir", "py_modules", "pip", "uv", "conda", "container",
                    "image_uri", "config", "nsight", "py_executable"}


def _rayjob() -> dict:
    return yaml.safe_load((REPO / "cluster" / "kuberay-rayjob.yaml").read_text())


def test_every_cluster_file_parses_as_a_kubernetes_object_or_a_runtime_env():
    files = sorted((REPO / "cluster").glob("*.yaml"))
    assert files
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f
        for d in docs:
            if "kind" in d:  # a Kubernetes object: what kubectl needs to map and name it
                api = d.get("apiVersion")
                assert isinstance(api, str) and ("/" in api or api == "v1"), f
                assert isinstance(d.get("metadata", {}).get("name"), str), f
            else:
                assert set(d) <= RUNTIME_ENV_KEYS, (f, set(d) - RUNTIME_ENV_KEYS)
                assert all(isinstance(v, str) for v in d.get("env_vars", {}).values()), f


def test_rayjob_matches_the_kuberay_v1_schema():
    job = _rayjob()
    jsonschema.validate(job, RAYJOB)
    spec = job["spec"]
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(env, dict) and set(env) <= RUNTIME_ENV_KEYS
    assert all(isinstance(v, str) for v in env.get("env_vars", {}).values())
    # the cluster runs the Ray the project pins
    ray_pin = re.search(r'"ray\[[^\]]*\]==([0-9.]+)', (REPO / "pyproject.toml").read_text()).group(1)
    assert spec["rayClusterSpec"]["rayVersion"].startswith(ray_pin.rstrip(".*"))
    for g in spec["rayClusterSpec"].get("workerGroupSpecs", []):
        lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2**31 - 1)
        assert lo <= g.get("replicas", lo) <= hi, g["groupName"]
    names = [g["groupName"] for g in spec["rayClusterSpec"].get("workerGroupSpecs", [])]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("breakage", ["typo_key", "bad_quantity", "int_start_param", "no_image", "wrong_api"])
def test_schema_catches_broken_rayjobs(breakage):
    job = copy.deepcopy(_rayjob())
    rc = job["spec"]["rayClusterSpec"]
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    if breakage == "typo_key":
        rc["workerGroupSpec"] = rc.pop("workerGroupSpecs")
    elif breakage == "bad_quantity":
        head["resources"]["limits"]["memory"] = "32GB"
    elif breakage == "int_start_param":
        rc["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    elif breakage == "no_image":
        del head["image"]
    elif breakage == "wrong_api":
        job["apiVersion"] = "ray.io/v1alpha1"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, RAYJOB)
