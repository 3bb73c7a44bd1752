"""The variables each cloud's own tools read that obstore does not, as obstore store config.

obstore reads its own environment (``AWS_*``, ``GOOGLE_SERVICE_ACCOUNT*``, ``AZURE_STORAGE_*`` ...;
docs/storage.md). Two variables that the clouds' own command-line tools and SDKs read are not among
them, and a user who set up ``gcloud`` or ``az`` has them:

- ``STORAGE_EMULATOR_HOST`` (Google Cloud client libraries): the endpoint of a GCS emulator, reached
  without credentials. obstore has no such variable; its way to the same is a service-account key
  holding ``"gcs_base_url"`` and ``"disable_oauth": true``, which :func:`fill` writes for it. (Without
  any credentials obstore's GCS client asks the instance metadata server for a token.)
- ``AZURE_STORAGE_CONNECTION_STRING`` (Azure CLI, every Azure SDK): ``AccountName``, ``AccountKey``,
  ``SharedAccessSignature``, ``BlobEndpoint`` (or ``DefaultEndpointsProtocol`` + ``EndpointSuffix``),
  or ``UseDevelopmentStorage=true`` (Azurite at its default address).

Each has the lowest precedence, as a whole: it is used only where neither ``storage_options`` nor
obstore's own variables say how to reach that cloud (credentials or endpoint), so two sources are
never mixed. Called by :class:`distckpt.storage.object.ObjectStore` when it builds a client.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional

from distckpt.core import CheckpointingException

__all__ = ["fill"]

# obstore's GCS config keys (without their ``google_`` prefix) that say how to reach GCS.
_GCS_KEYS = frozenset(
    {"service_account", "service_account_path", "service_account_key", "application_credentials", "base_url"}
    | {"bearer_token"}
)
# obstore's own GOOGLE_* variables among them. GOOGLE_APPLICATION_CREDENTIALS is not one: like the
# Google client libraries, an emulator host wins over application default credentials.
_GCS_ENV = ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY")
_GCS_ENV += ("GOOGLE_BASE_URL", "GOOGLE_BEARER_TOKEN")

# obstore's Azure config keys (and their aliases) that name an account, a credential or an endpoint;
# its environment variables are the same names upper-cased.
_AZURE_KEYS = frozenset(
    {
        "account_name",
        "azure_storage_account_name",
        "account_key",
        "access_key",
        "master_key",
        "azure_storage_account_key",
        "azure_storage_access_key",
        "azure_storage_master_key",
        "sas_key",
        "sas_token",
        "azure_storage_sas_key",
        "azure_storage_sas_token",
        "endpoint",
        "azure_endpoint",
        "azure_storage_endpoint",
        "use_emulator",
        "azure_storage_use_emulator",
        "bearer_token",
        "token",
        "azure_storage_token",
    }
)


def fill(scheme: str, options: Dict[str, Any], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``options`` (obstore store config and client options, flat) with what ``STORAGE_EMULATOR_HOST``
    (``gs``) or ``AZURE_STORAGE_CONNECTION_STRING`` (``az`` and its aliases) add, where they apply."""
    env = os.environ if environ is None else environ
    if scheme == "gs":
        return _gcs(options, env)
    if scheme in ("az", "abfs", "abfss", "adl", "azure"):
        return _azure(options, env)
    return options


def _gcs(options: Dict[str, Any], env: Mapping[str, str]) -> Dict[str, Any]:
    host = env.get("STORAGE_EMULATOR_HOST", "").strip()
    given = {k.lower().removeprefix("google_") for k in options}
    if not host or given & _GCS_KEYS or any(env.get(k) for k in _GCS_ENV):
        return options
    base = host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"
    key = {
        "gcs_base_url": base,
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    return {**options, "service_account_key": json.dumps(key)}


def _azure(options: Dict[str, Any], env: Mapping[str, str]) -> Dict[str, Any]:
    text = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if not text or {k.lower() for k in options} & _AZURE_KEYS or any(env.get(k.upper()) for k in _AZURE_KEYS):
        return options
    parts: Dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, value = item.partition("=")
        if not eq:
            raise CheckpointingException(
                f"AZURE_STORAGE_CONNECTION_STRING: {name!r} is not a Key=Value setting "
                f"(settings are separated by ';')"
            )
        parts[name.strip().lower()] = value.strip()
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        return {**options, "use_emulator": "true"}
    out = dict(options)
    for name, key in (("accountname", "account_name"), ("accountkey", "account_key")):
        if parts.get(name):
            out[key] = parts[name]
    if parts.get("sharedaccesssignature"):
        out["sas_key"] = parts["sharedaccesssignature"]
    endpoint = parts.get("blobendpoint")
    if not endpoint and parts.get("endpointsuffix") and parts.get("accountname"):
        protocol = parts.get("defaultendpointsprotocol", "https")
        endpoint = f"{protocol}://{parts['accountname']}.blob.{parts['endpointsuffix']}"
    if endpoint:
        out["endpoint"] = endpoint.rstrip("/")
        if endpoint.lower().startswith("http://"):
            out.setdefault("allow_http", True)
    return out
