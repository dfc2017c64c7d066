"""The parts of Dagster's Helm chart (dagster/dagster 1.13) that decide what a run's or a step's Job holds,
rendered from deploy/k8s/values.yaml the way the chart's templates render them. helm cannot run here (it would
fetch the chart); these few templates are small and stable, so they are followed by hand:

- `helpers/instance/_run-launcher.tpl` (`dagsterYaml.runLauncher.k8s`): the `run_launcher` section of the
  instance's dagster.yaml, camelCase values turned into the launcher's snake_case config;
- `dagster-user-deployments/templates/deployment-user.yaml` and `helpers/_helpers.tpl`
  (`dagsterUserDeployments.k8sContainerContext`): the code server's environment, among it
  `DAGSTER_CURRENT_IMAGE` (the image every run of the location gets) and
  `DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT` (its volumes, environment and service account, which
  `includeConfigInLaunchedRuns`, on by default, passes to every run and step pod);
- the names of the objects the chart itself creates and those Jobs refer to: the service accounts, the
  user deployment's environment config map, the instance config map and the PostgreSQL password secret.

Chart defaults used where values.yaml sets nothing are the chart's own (`global.dagsterHome`,
`loadInclusterConfig: true`, `imagePullPolicy: Always`, the service-account and config-map names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DAGSTER_HOME = "/opt/dagster/dagster_home"  # the chart's global.dagsterHome
POSTGRES_PASSWORD_KEY = "postgresql-password"


@dataclass(frozen=True)
class Release:
    """`helm upgrade --install <name> dagster/dagster -n <namespace> -f values.yaml`."""

    values: dict[str, Any]
    name: str = "eagle3"
    namespace: str = "default"

    @classmethod
    def from_file(cls, path: Path, **kw: str) -> Release:
        return cls(yaml.safe_load(path.read_text()), **kw)

    @staticmethod
    def _fullname(release: str, chart: str) -> str:
        """`dagster.fullname`: the release name alone when it contains the chart's name, else both."""
        return (release if chart in release else f"{release}-{chart}")[:63].rstrip("-")

    @property
    def fullname(self) -> str:
        return self._fullname(self.name, "dagster")

    @property
    def user_fullname(self) -> str:
        return self._fullname(self.name, "dagster-user-deployments")

    @property
    def service_account(self) -> str:
        """`dagster.serviceAccountName`: the webserver's, daemon's and run launcher's."""
        g = self.values.get("global") or {}
        return (
            g.get("serviceAccountName")
            or (self.values.get("serviceAccount") or {}).get("name")
            or self.fullname
        )

    @property
    def user_service_account(self) -> str:
        """`dagsterUserDeployments.serviceAccountName`: the code servers', passed to their runs."""
        g = self.values.get("global") or {}
        sub = (self.values.get("dagster-user-deployments") or {}).get("serviceAccount") or {}
        return g.get("serviceAccountName") or sub.get("name") or f"{self.user_fullname}-user-deployments"

    @property
    def postgres_secret(self) -> str:
        return (self.values.get("global") or {}).get("postgresqlSecretName") or "dagster-postgresql-secret"

    @property
    def deployments(self) -> list[dict[str, Any]]:
        return (self.values.get("dagster-user-deployments") or {}).get("deployments") or []

    @staticmethod
    def image(image: dict[str, Any]) -> str:
        """`dagster.dagsterImage.name`: repository:tag."""
        return f"{image['repository']}:{image['tag']}"

    def user_env_configmap(self, deployment: dict[str, Any]) -> str:
        return f"{self.user_fullname}-{deployment['name']}-user-env"

    def container_context(self, deployment: dict[str, Any]) -> dict[str, Any]:
        """`dagsterUserDeployments.k8sContainerContext` for one deployment."""
        k8s: dict[str, Any] = {"image_pull_policy": deployment["image"].get("pullPolicy")}
        if self.values.get("imagePullSecrets"):
            k8s["image_pull_secrets"] = self.values["imagePullSecrets"]
        k8s["env_config_maps"] = [
            self.user_env_configmap(deployment),
            *[c["name"] for c in deployment.get("envConfigMaps") or [] if "name" in c],
        ]
        secrets = [s["name"] for s in deployment.get("envSecrets") or [] if "name" in s]
        if secrets:
            k8s["env_secrets"] = secrets
        for key, out in (
            ("volumeMounts", "volume_mounts"),
            ("volumes", "volumes"),
            ("labels", "labels"),
            ("resources", "resources"),
        ):
            if deployment.get(key):
                k8s[out] = deployment[key]
        if deployment.get("schedulerName"):
            k8s["scheduler_name"] = deployment["schedulerName"]
        k8s["namespace"] = self.namespace
        k8s["service_account_name"] = self.user_service_account
        if isinstance(deployment.get("env"), list):
            k8s["env"] = deployment["env"]
        run_k8s: dict[str, Any] = {"pod_spec_config": {"automount_service_account_token": True}}
        if deployment.get("annotations"):
            run_k8s["pod_template_spec_metadata"] = {"annotations": deployment["annotations"]}
        k8s["run_k8s_config"] = run_k8s
        return {"k8s": k8s}

    def code_server(self, deployment: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The code server container's arguments after `dagster api grpc -h 0.0.0.0 -p <port>`, and its
        environment (`deployment-user.yaml`; env given as a list is set on the container itself)."""
        include = (deployment.get("includeConfigInLaunchedRuns") or {"enabled": True}).get("enabled", True)
        env = {"DAGSTER_CURRENT_IMAGE": self.image(deployment["image"])}
        if include and deployment.get("dagsterApiGrpcArgs"):
            env["DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT"] = json.dumps(self.container_context(deployment))
        if isinstance(deployment.get("env"), list):
            env.update({e["name"]: e["value"] for e in deployment["env"] if "value" in e})
        return list(deployment["dagsterApiGrpcArgs"]), env

    def run_launcher(self) -> dict[str, Any]:
        """The instance's `run_launcher` (`dagsterYaml.runLauncher.k8s`)."""
        launcher = self.values["runLauncher"]
        assert launcher["type"] == "K8sRunLauncher", launcher["type"]
        k = launcher["config"]["k8sRunLauncher"]
        config: dict[str, Any] = {
            "load_incluster_config": k.get("loadInclusterConfig", True),
            "job_namespace": k.get("jobNamespace") or self.namespace,
            "image_pull_policy": k.get("imagePullPolicy", "Always"),
            "service_account_name": self.service_account,
            "dagster_home": (self.values.get("global") or {}).get("dagsterHome") or DAGSTER_HOME,
            "instance_config_map": f"{self.fullname}-instance",
            "postgres_password_secret": self.postgres_secret,
        }
        if k.get("kubeconfigFile"):
            config["kubeconfig_file"] = k["kubeconfigFile"]
        if self.values.get("imagePullSecrets"):
            config["image_pull_secrets"] = self.values["imagePullSecrets"]
        if "image" in k:
            config["job_image"] = self.image(k["image"])
        for key, out in (("envConfigMaps", "env_config_maps"), ("envSecrets", "env_secrets")):
            names = [c["name"] for c in k.get(key) or [] if "name" in c]
            if names:
                config[out] = names
        for key, out in (
            ("envVars", "env_vars"),
            ("volumeMounts", "volume_mounts"),
            ("volumes", "volumes"),
            ("labels", "labels"),
            ("resources", "resources"),
            ("securityContext", "security_context"),
        ):
            if k.get(key):
                config[out] = k[key]
        if k.get("failPodOnRunFailure"):
            config["fail_pod_on_run_failure"] = True
        if k.get("schedulerName"):
            config["scheduler_name"] = k["schedulerName"]
        run_k8s = k.get("runK8sConfig") or {}
        parts = {
            "containerConfig": "container_config",
            "podSpecConfig": "pod_spec_config",
            "podTemplateSpecMetadata": "pod_template_spec_metadata",
            "jobSpecConfig": "job_spec_config",
            "jobMetadata": "job_metadata",
        }
        if run_k8s:
            config["run_k8s_config"] = {out: run_k8s[key] for key, out in parts.items() if run_k8s.get(key)}
        return {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": config}

    def objects(self) -> list[dict[str, Any]]:
        """The objects the chart creates that run and step Jobs refer to (names; contents are placeholders
        where the test needs none)."""
        ns = {"namespace": self.namespace}
        out: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": self.service_account, **ns}},
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"{self.fullname}-instance", **ns},
                "data": {"dagster.yaml": yaml.safe_dump({"run_launcher": self.run_launcher()})},
            },
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": self.postgres_secret, **ns},
                "type": "Opaque",
                "stringData": {POSTGRES_PASSWORD_KEY: "chart-generated"},
            },
        ]
        if self.deployments:
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": self.user_service_account, **ns},
                }
            )
        for deployment in self.deployments:
            env = deployment.get("env")
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": self.user_env_configmap(deployment), **ns},
                    "data": dict(env) if isinstance(env, dict) else {},
                }
            )
        return out
