"""Kubernetes objects proven: the real dagster-k8s `K8sRunLauncher` and `k8s_job_executor`, configured from
deploy/k8s as the Helm chart renders it, launch runs of the shipped jobs and a Job for every step of them
against a recording API server (tests/support/k8s_api.py, the one stand-in: no control plane runs here). The
Jobs they post are held to what each pod must carry: the values' image and environment, volumes that the
deploy files define, the run pod's small requests on the run pod only, per-kind requests on the steps (GPUs on
the GPU steps), the API key's secret on the `responses` steps only. Every object and every manifest under
deploy/ passes `kubernetes-validate --strict` for Kubernetes 1.31 and the newest version it knows.
"""

from __future__ import annotations

import copy
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_assets.config import ProjectConfig, load_config

from .support.helm_chart import Release
from .support.k8s_api import RecordingApiServer
from .support.k8s_cluster import (
    DEPLOY,
    code_server,
    deploy_objects,
    install,
    launch_run,
    launch_steps,
    manifests,
)
from .support.projects import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytest.importorskip("dagster_k8s")

VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
CONFIG_MOUNT = "/config/eagle3.yaml"  # where values.yaml's pods read the project config
GPU = "nvidia.com/gpu"
PARTITION = "B1"
# Managed vLLM extraction plans one unit per replica; the transformers engine one step per shard.
MANAGED = {"hidden_states.plan_hidden_state_shards": {"result": ["replica_0_of_2", "replica_1_of_2"]}}
SHARDS = {"hidden_states.plan_hidden_state_shards": {"result": ["shard_00000", "shard_00001"]}}
SHIPPED_JOBS = {"training_data": None, "hidden_states_job": MANAGED, "acceptance_job": None}


@dataclass
class Cluster:
    """One release of the chart and what its launcher and executor posted."""

    api: RecordingApiServer
    release: Release
    cfg: ProjectConfig
    run_jobs: dict[str, dict] = field(default_factory=dict)  # Dagster job name -> the run's Job
    step_jobs: dict[str, dict] = field(default_factory=dict)  # step key -> the step's Job
    pools: dict[str, str | None] = field(default_factory=dict)  # step key -> the pool of its op


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _env(job: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(job).get("env") or []}


def _secret_refs(job: dict) -> list[str]:
    return [e["secretRef"]["name"] for e in _container(job).get("envFrom") or [] if "secretRef" in e]


def _pool(defs: Any, job_name: str, step_key: str) -> str | None:
    """The pool of the op a step runs, read from the definitions (the kind the step's pod must have)."""
    from dagster._core.definitions.dependency import NodeHandle

    handle = NodeHandle.from_string(step_key.split("[")[0])
    return defs.resolve_job_def(job_name).graph.get_node(handle).definition.pool


def run_pod_requests(release: Release) -> dict[str, str]:
    return release.values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["containerConfig"][
        "resources"
    ]["requests"]


def gpus_wanted(cfg: ProjectConfig, step_key: str) -> str:
    """A GPU step's devices: those of the vLLM server it starts itself (the gate with `acceptance.engine:
    vllm`, a managed extraction step: tensor x pipeline parallel), else the `gpu` kind's count."""
    server = None
    if step_key == "acceptance" and cfg.acceptance.engine == "vllm":
        server = cfg.acceptance.vllm
    elif step_key.startswith("hidden_states.extract_hidden_states_managed["):
        server = cfg.hidden_states.vllm
    if server is not None and server.tensor_parallel_size:
        return str(server.tensor_parallel_size * server.pipeline_parallel_size)
    return str(cfg.execution.k8s_steps.gpu.gpus)


def step_pod_problems(
    job: dict, pool: str | None, cfg: ProjectConfig, run_requests: dict, step_key: str = ""
) -> list[str]:
    """What is wrong with a step's pod for a step of an op in `pool`: its requests must be its kind's
    (never the run pod's), GPUs exactly on GPU steps (as many as `gpus_wanted`), the API key's secret
    exactly on `responses` steps."""
    kind = {"gpu": "gpu", "llm_api": "responses"}.get(pool or "", "cpu")
    size = getattr(cfg.execution.k8s_steps, kind)
    resources = _container(job).get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    problems = []
    if any(requests.get(k) == v for k, v in run_requests.items()):
        problems.append(f"keeps the run pod's requests: {requests}")
    if (requests.get("cpu"), requests.get("memory"), limits.get("memory")) != (
        size.cpu,
        size.memory,
        size.memory,
    ):
        problems.append(f"requests {requests} / limits {limits}, not the {kind} kind's {size}")
    gpus = (requests.get(GPU), limits.get(GPU))
    if kind == "gpu":
        want = gpus_wanted(cfg, step_key)
        if gpus != (want, want):
            problems.append(f"a GPU step with {GPU} requests/limits {gpus}, not {want}")
        tolerations = job["spec"]["template"]["spec"].get("tolerations") or []
        if not any(t.get("key") == GPU for t in tolerations):
            problems.append("a GPU step that tolerates no GPU node")
        if "/dev/shm" not in {m["mountPath"] for m in _container(job).get("volumeMounts") or []}:
            problems.append("a GPU step without a /dev/shm of its own")
    elif any(gpus):
        problems.append(f"a {kind} step asks for GPUs: {gpus}")
    has_key = cfg.execution.k8s_api_key_secret in _secret_refs(job)
    if has_key != (kind == "responses"):
        problems.append(f"the API key's secret {'on' if has_key else 'missing from'} a {kind} step")
    return problems


@contextmanager
def cluster(
    tmp: Path, config_text: str, jobs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    """The chart installed from deploy/k8s (values.yaml, with `config_text` as the eagle3-config map's
    file), a run of each of `jobs` launched by its K8sRunLauncher and every step of it by the executor."""
    from dagster._core.test_utils import instance_for_test

    from eagle3_assets.definitions import build_definitions

    release = Release.from_file(DEPLOY / "values.yaml")
    config = tmp / "config" / "eagle3.yaml"  # the config map's file, as the pods see it at /config
    config.parent.mkdir(parents=True)
    config.write_text(config_text)
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))  # the run pod's code location reads it (launch_steps)
    cfg = load_config(config)
    defs = build_definitions(cfg, str(config))
    with ExitStack() as stack:
        api = stack.enter_context(RecordingApiServer())
        kubeconfig = api.kubeconfig(tmp / "kubeconfig")
        install(api, kubeconfig, release)
        launcher = release.run_launcher()  # in the cluster: in-cluster config; here: the recording server
        launcher["config"].update(load_incluster_config=False, kubeconfig_file=str(kubeconfig))
        instance = stack.enter_context(instance_for_test(overrides={"run_launcher": launcher}))
        server = stack.enter_context(code_server(release, config, tmp / "code-server.log"))
        result = Cluster(api, release, cfg)
        for job_name, dynamic in jobs.items():
            before = len(api.created("Job"))
            run = launch_run(instance, server, job_name, PARTITION)
            launched = launch_steps(instance, run, dynamic)
            posted = api.created("Job")[before:]
            result.run_jobs[job_name] = posted[0]
            for job in posted[1:]:
                key = _env(job)["DAGSTER_RUN_STEP_KEY"]
                result.step_jobs[key] = job
                result.pools[key] = _pool(defs, job_name, key)
            assert sorted(launched) == sorted(k for k in result.step_jobs if k in launched)
        yield result


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Iterator[Cluster]:
    """deploy/k8s as shipped: its values, its project config, the three jobs of one partition."""
    with pytest.MonkeyPatch.context() as mp:
        tmp = tmp_path_factory.mktemp("k8s-shipped")
        with cluster(tmp, (DEPLOY / "eagle3.k8s.yaml").read_text(), SHIPPED_JOBS, mp) as c:
            yield c


# -- the run pod -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_run_pods_carry_the_values_image_env_volumes_and_size(shipped):
    release, api = shipped.release, shipped.api
    deployment = release.deployments[0]
    image = release.image(deployment["image"])
    for name, job in shipped.run_jobs.items():
        container = _container(job)
        spec = job["spec"]["template"]["spec"]
        assert container["image"] == image, name
        assert container["args"][:3] == ["dagster", "api", "execute_run"]
        env = _env(job)
        assert env["EAGLE3_CONFIG"] == CONFIG_MOUNT
        assert env["DAGSTER_HOME"] == release.run_launcher()["config"]["dagster_home"]
        assert env["DAGSTER_PG_PASSWORD"] == {
            "secretKeyRef": {"key": "postgresql-password", "name": release.postgres_secret}
        }
        assert container["resources"] == {"requests": run_pod_requests(release)}  # it only orchestrates
        assert not _secret_refs(job), "the run pod never holds the API key"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/config"]]["configMap"]["name"] == "eagle3-config"
        assert (
            volumes[mounts[shipped.cfg.storage.root]]["persistentVolumeClaim"]["claimName"] == "eagle3-data"
        )
        assert spec["serviceAccountName"] == release.user_service_account
        assert api.missing_references(job) == [], name
    # The file the pods read is the shipped config, under the key the mount path names.
    config_map = api.get("ConfigMap", "eagle3-config")
    assert config_map["data"][Path(CONFIG_MOUNT).name] == (DEPLOY / "eagle3.k8s.yaml").read_text()


# -- the step pods ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_step_pod_is_sized_for_its_kind_and_only_responses_hold_the_key(shipped):
    run_requests = run_pod_requests(shipped.release)
    problems = {
        key: p
        for key, job in shipped.step_jobs.items()
        if (p := step_pod_problems(job, shipped.pools[key], shipped.cfg, run_requests, key))
    }
    assert problems == {}
    pools = shipped.pools
    assert {k for k, p in pools.items() if p == "llm_api"} == {"responses"}
    managed = {f"hidden_states.extract_hidden_states_managed[replica_{i}_of_2]" for i in range(2)}
    gpu_steps = {k for k, p in pools.items() if p == "gpu"}
    assert {"acceptance", "hidden_states_hidden_states_spot_check"} | managed <= gpu_steps
    # Each step that starts the target's server asks for the whole node it spans; the spot check for one.
    for key in managed | {"acceptance"}:
        assert _container(shipped.step_jobs[key])["resources"]["limits"][GPU] == "8", key
    spot = shipped.step_jobs["hidden_states_hidden_states_spot_check"]
    assert _container(spot)["resources"]["limits"][GPU] == "1"
    image = shipped.release.image(shipped.release.deployments[0]["image"])
    for key, job in shipped.step_jobs.items():
        assert _container(job)["image"] == image, key
        assert _env(job)["EAGLE3_CONFIG"] == CONFIG_MOUNT, key
        assert shipped.api.missing_references(job) == [], key
        mounts = {m["mountPath"] for m in _container(job)["volumeMounts"]}
        assert {"/config", shipped.cfg.storage.root} <= mounts, key


@pytest.mark.slow
def test_transformers_extraction_puts_every_shard_step_on_a_gpu(tmp_path, monkeypatch):
    """With the in-process engine each planned shard is a step of its own, each on its own GPU."""
    cfg = yaml.safe_load((DEPLOY / "eagle3.k8s.yaml").read_text())
    cfg["hidden_states"]["engine"] = "transformers"
    cfg["execution"]["k8s_steps"]["gpu"]["gpus"] = 2
    with cluster(tmp_path, yaml.safe_dump(cfg), {"hidden_states_job": SHARDS}, monkeypatch) as c:
        run_requests = run_pod_requests(c.release)
        shards = [k for k in c.step_jobs if "extract_hidden_state_shard[" in k]
        assert len(shards) == 2
        for key, job in c.step_jobs.items():
            assert step_pod_problems(job, c.pools[key], c.cfg, run_requests, key) == [], key
        assert all(_container(c.step_jobs[k])["resources"]["limits"][GPU] == "2" for k in shards)


@pytest.mark.slow
def test_the_pod_checks_catch_the_step_pods_the_issue_found(tmp_path, monkeypatch):
    """As shipped before, the executor knew only `max_concurrent`: every step pod kept the run pod's 500m/1Gi,
    the GPU steps included. The same checks fail on what that executor launches."""
    import eagle3_assets.definitions as definitions

    monkeypatch.setattr(
        definitions,
        "k8s_executor_config",
        lambda cfg, nodes: {"max_concurrent": cfg.execution.max_concurrent_steps},
    )
    config_text = (DEPLOY / "eagle3.k8s.yaml").read_text()
    with cluster(tmp_path, config_text, {"acceptance_job": None, "training_data": None}, monkeypatch) as c:
        run_requests = run_pod_requests(c.release)
        gate = step_pod_problems(c.step_jobs["acceptance"], "gpu", c.cfg, run_requests, "acceptance")
        assert any("run pod's requests" in p for p in gate)
        responses = step_pod_problems(c.step_jobs["responses"], "llm_api", c.cfg, run_requests)
        assert any("run pod's requests" in p for p in responses)
        tokens = step_pod_problems(c.step_jobs["tokens"], None, c.cfg, run_requests)
        assert any("run pod's requests" in p for p in tokens)


@pytest.mark.slow
def test_a_mount_of_a_volume_no_deploy_file_defines_is_caught(tmp_path, monkeypatch):
    """values.yaml mounting a claim that no deploy file creates: the launched run's Job refers to a missing
    object (its pod would never start)."""
    values = copy.deepcopy(Release.from_file(DEPLOY / "values.yaml").values)
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    launcher["volumes"] = [
        *launcher["volumes"],
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}},
    ]
    launcher["volumeMounts"] = [*launcher["volumeMounts"], {"name": "scratch", "mountPath": "/scratch"}]
    monkeypatch.setattr(Release, "from_file", classmethod(lambda cls, path, **kw: cls(values, **kw)))
    config_text = (DEPLOY / "eagle3.k8s.yaml").read_text()
    with cluster(tmp_path, config_text, {"acceptance_job": None}, monkeypatch) as c:
        assert c.api.missing_references(c.run_jobs["acceptance_job"]) == ["PersistentVolumeClaim scratch"]
        assert c.api.missing_references(c.step_jobs["acceptance"]) == ["PersistentVolumeClaim scratch"]


def test_a_gpu_step_without_its_gpus_or_with_the_key_is_caught():
    """The checks above, on Jobs dagster-k8s builds from each kind's pod config: a GPU step given a CPU
    step's pod, or a CPU step given the responses pod (and its secret), fails them."""
    from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, construct_dagster_k8s_job
    from kubernetes.client import ApiClient

    from eagle3_assets.k8s import pod_config

    cfg = load_config(DEPLOY / "eagle3.k8s.yaml")
    run_requests = run_pod_requests(Release.from_file(DEPLOY / "values.yaml"))

    def job(kind: str) -> dict:
        user = UserDefinedDagsterK8sConfig.from_dict(pod_config(cfg, kind))
        built = construct_dagster_k8s_job(DagsterK8sJobConfig(job_image="i"), ["x"], "j", user)
        return ApiClient().sanitize_for_serialization(built)

    assert step_pod_problems(job("gpu"), "gpu", cfg, run_requests) == []
    assert any("a GPU step with" in p for p in step_pod_problems(job("cpu"), "gpu", cfg, run_requests))
    assert any("on a cpu step" in p for p in step_pod_problems(job("responses"), None, cfg, run_requests))


# -- schemas ---------------------------------------------------------------------------------------------


def _validate(obj: dict) -> list[str]:
    problems = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            name = obj.get("metadata", {}).get("name")
            problems.append(f"{obj.get('kind')} {name} (Kubernetes {version}): {getattr(e, 'message', e)}")
    return problems


@pytest.mark.slow
def test_every_posted_object_passes_kubernetes_validate_strict(shipped):
    posted = shipped.api.created()
    assert {o["kind"] for o in posted} >= {
        "Job",
        "ConfigMap",
        "Secret",
        "PersistentVolumeClaim",
        "Deployment",
    }
    assert [p for o in posted for p in _validate(o)] == []
    assert [(r.method, r.path) for r in shipped.api.requests if r.status >= 400] == []


def test_every_manifest_under_deploy_passes_kubernetes_validate_strict():
    found = {path.name: manifests(path) for path in sorted(REPO.glob("deploy/**/*.yaml"))}
    objects = [o for docs in found.values() for o in docs]
    assert {"storage.yaml", "vllm.yaml"} <= {name for name, docs in found.items() if docs}
    assert [p for o in objects for p in _validate(o)] == []


def test_kubernetes_validate_strict_refuses_what_it_should():
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "x"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i", "resourcez": {}}]}}},
    }
    assert _validate(job) and "resourcez" in _validate(job)[0]


# -- the deploy files, without launching anything --------------------------------------------------------


def test_the_deploy_files_define_every_volume_they_mount(tmp_path):
    """The vLLM Deployment and a pod with every volume values.yaml mounts (code server and run launcher), in
    a cluster holding only what the deploy files create."""
    release = Release.from_file(DEPLOY / "values.yaml")
    launcher = release.values["runLauncher"]["config"]["k8sRunLauncher"]
    volumes = {v["name"]: v for v in [*release.deployments[0]["volumes"], *launcher["volumes"]]}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "values-volumes"},
        "spec": {"containers": [{"name": "c", "image": "i"}], "volumes": list(volumes.values())},
    }
    with RecordingApiServer() as api:
        install(api, api.kubeconfig(tmp_path / "kubeconfig"), release)
        assert api.missing_references(pod) == []
        assert api.missing_references(api.get("Deployment", "eagle3-vllm")) == []
        bare = {
            **pod,
            "spec": {
                **pod["spec"],
                "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "nope"}}],
            },
        }
        assert api.missing_references(bare) == ["PersistentVolumeClaim nope"]
    claim = next(o for o in deploy_objects(release) if o["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "eagle3-data" and claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_k8s_config_reads_its_sources_from_the_image():
    """The config map holds eagle3.yaml alone, at /config: its sources must be paths the image has."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    workdir = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("WORKDIR"))
    copied = [line.split()[1:] for line in dockerfile.splitlines() if line.startswith("COPY")]
    cfg = yaml.safe_load((DEPLOY / "eagle3.k8s.yaml").read_text())
    for key, dataset in cfg["datasets"].items():
        source = Path(dataset["source"])
        assert source.is_absolute(), f"{key}: {source} would resolve under /config, which holds no prompts"
        relative = source.relative_to(workdir)
        assert any(relative.parts[0] == Path(src).name for *srcs, _ in copied for src in srcs), key
        assert (REPO / relative).is_file(), key


def test_the_vllm_the_k8s_config_starts_is_one_the_image_installs():
    """The managed extraction steps and the gate start vLLM from `python:`: an environment the image builds,
    with a version the tests ran."""
    from resources.vllm.cpu_build import TESTED_VLLM_VERSIONS

    runs = [line.removeprefix("RUN ") for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    cfg = load_config(DEPLOY / "eagle3.k8s.yaml")
    assert cfg.hidden_states.vllm.managed and cfg.acceptance.engine == "vllm"
    for server in (cfg.hidden_states.vllm, cfg.acceptance.vllm):
        env = str(Path(server.python or "").parent.parent)
        installs = [c.split() for r in runs for c in r.split("&&") if c.split()[:1] == [f"{env}/bin/pip"]]
        assert any(f"python -m venv {env}" in r for r in runs), f"the image builds no {env}"
        pins = [w.partition("==")[2] for c in installs for w in c if w.startswith("vllm==")]
        assert pins and all(p in TESTED_VLLM_VERSIONS for p in pins), (env, installs)


def test_the_recording_server_refuses_what_the_api_server_refuses(tmp_path):
    from kubernetes import client, config

    def job(container: dict, volumes: list | None = None) -> dict:
        spec = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i", **container}]}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"j{abs(hash(str(container)))}"},
            "spec": {"template": {"spec": {**spec, "volumes": volumes or []}}},
        }

    with RecordingApiServer() as api:
        batch = client.BatchV1Api(config.new_client_from_config(str(api.kubeconfig(tmp_path / "kc"))))
        bad = {
            "GPU request without a limit": job({"resources": {"requests": {GPU: "1"}}}),
            "GPU request unlike its limit": job(
                {"resources": {"requests": {GPU: "1"}, "limits": {GPU: "2"}}}
            ),
            "more memory requested than the limit": job(
                {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}
            ),
            "a mount of no volume": job({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
            "two volumes of one name": job(
                {}, [{"name": "v", "emptyDir": {}}, {"name": "v", "emptyDir": {}}]
            ),
        }
        for why, body in bad.items():
            with pytest.raises(client.ApiException) as refused:
                batch.create_namespaced_job("default", body)
            assert refused.value.status == 422, why
        good = job({"resources": {"requests": {GPU: "1", "cpu": "1"}, "limits": {GPU: "1"}}})
        assert batch.create_namespaced_job("default", good).metadata.uid
        with pytest.raises(client.ApiException) as twice:
            batch.create_namespaced_job("default", good)
        assert twice.value.status == 409
        with pytest.raises(client.ApiException) as missing:
            batch.read_namespaced_job_status("absent", "default")
        assert missing.value.status == 404
        with pytest.raises(urllib.error.HTTPError) as anonymous:  # no bearer token: 401
            urllib.request.urlopen(f"{api.url}/apis/batch/v1/namespaces/default/jobs")
        assert anonymous.value.code == 401
