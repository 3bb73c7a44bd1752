"""Credentials and endpoints as users set them, per cloud: the variables the clouds' own tools read
(``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING``; distckpt/storage/cloud_env.py),
obstore's own variables, and ``storage_options``, each reaching the real servers of
tests/conftest.py; and which one wins when several are set."""

from __future__ import annotations

import json

import pytest

from distckpt import CheckpointingException
from distckpt.storage import cloud_env, open_store
from tests.support import servers

EMULATOR = "http://127.0.0.1:4443"
CONNECTION = (
    f"DefaultEndpointsProtocol=http;AccountName={servers.AZURITE_ACCOUNT};AccountKey={servers.AZURITE_KEY};"
    f"BlobEndpoint=http://127.0.0.1:10000/{servers.AZURITE_ACCOUNT};"
)


def _round_trip(url, options=None):
    store = open_store(url, options)
    store.put("probe", b"reached")
    assert bytes(store.get("probe")) == b"reached"
    assert store.list() == {"probe": 7}


# --------------------------------------------------------------------------- GCS


def test_storage_emulator_host_becomes_an_anonymous_client_to_that_endpoint():
    for host in (EMULATOR, "127.0.0.1:4443", EMULATOR + "/"):
        key = json.loads(cloud_env.fill("gs", {}, {"STORAGE_EMULATOR_HOST": host})["service_account_key"])
        assert key["gcs_base_url"] == EMULATOR and key["disable_oauth"] is True


@pytest.mark.parametrize(
    "options,env",
    [
        ({"service_account_path": "/k.json"}, {}),
        ({"google_service_account_key": "{}"}, {}),
        ({"base_url": "http://other"}, {}),
        ({}, {"GOOGLE_SERVICE_ACCOUNT": "/k.json"}),
        ({}, {"GOOGLE_SERVICE_ACCOUNT_KEY": "{}"}),
    ],
)
def test_storage_emulator_host_yields_to_options_and_to_obstore_s_own_variables(options, env):
    env = {"STORAGE_EMULATOR_HOST": EMULATOR, **env}
    assert cloud_env.fill("gs", dict(options), env) == options


def test_gcs_is_reached_through_storage_emulator_host(gcs_url):
    import os

    assert os.environ["STORAGE_EMULATOR_HOST"].startswith("http://127.0.0.1:")
    _round_trip(gcs_url)


def test_gcs_is_reached_through_obstore_s_own_service_account_variable(gcs_url, tmp_path, monkeypatch):
    import os

    key = {"gcs_base_url": os.environ["STORAGE_EMULATOR_HOST"], "disable_oauth": True}
    key |= {"client_email": "", "private_key": "", "private_key_id": ""}
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(key))
    _round_trip(gcs_url)


# --------------------------------------------------------------------------- Azure


def test_a_connection_string_gives_account_key_and_endpoint():
    got = cloud_env.fill("az", {}, {"AZURE_STORAGE_CONNECTION_STRING": CONNECTION})
    assert got == {
        "account_name": servers.AZURITE_ACCOUNT,
        "account_key": servers.AZURITE_KEY,  # its trailing '=' kept
        "endpoint": f"http://127.0.0.1:10000/{servers.AZURITE_ACCOUNT}",
        "allow_http": True,
    }


def test_a_connection_string_with_a_sas_and_an_endpoint_suffix():
    text = "AccountName=acct;SharedAccessSignature=sv=2022&sig=abc%3D;EndpointSuffix=core.chinacloudapi.cn"
    got = cloud_env.fill("abfs", {}, {"AZURE_STORAGE_CONNECTION_STRING": text})
    assert got == {
        "account_name": "acct",
        "sas_key": "sv=2022&sig=abc%3D",
        "endpoint": "https://acct.blob.core.chinacloudapi.cn",
    }


def test_use_development_storage_is_obstore_s_emulator_mode():
    env = {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}
    assert cloud_env.fill("az", {}, env) == {"use_emulator": "true"}


@pytest.mark.parametrize(
    "options,env",
    [
        ({"account_name": "other"}, {}),
        ({"AZURE_STORAGE_SAS_TOKEN": "sv=1"}, {}),
        ({}, {"AZURE_STORAGE_ACCOUNT_NAME": "other"}),
        ({}, {"AZURE_STORAGE_USE_EMULATOR": "true"}),
    ],
)
def test_a_connection_string_yields_as_a_whole_to_options_and_to_obstore_s_own_variables(options, env):
    env = {"AZURE_STORAGE_CONNECTION_STRING": CONNECTION, **env}
    assert cloud_env.fill("az", dict(options), env) == options


def test_a_malformed_connection_string_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=a;garbage")
    with pytest.raises(CheckpointingException, match="AZURE_STORAGE_CONNECTION_STRING: 'garbage'"):
        open_store("az://container/ckpt")


def test_azure_is_reached_through_the_connection_string(az_url):
    import os

    assert "BlobEndpoint=http://127.0.0.1:" in os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    _round_trip(az_url)


def test_azure_is_reached_through_obstore_s_emulator_variables(az_url, monkeypatch):
    """obstore's own emulator mode: ``AZURE_STORAGE_USE_EMULATOR`` and the Azurite address in
    ``AZURITE_BLOB_STORAGE_URL``; it takes precedence over the connection string, which here
    names an address where nothing listens."""
    import os

    text = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    endpoint = dict(p.split("=", 1) for p in text.split(";") if p)["BlobEndpoint"]
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", text.replace(endpoint, "http://127.0.0.1:9/x"))
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", endpoint.rsplit("/", 1)[0])
    _round_trip(az_url)


def test_azure_is_reached_through_storage_options_over_the_environment(az_url, monkeypatch):
    import os

    endpoint = dict(p.split("=", 1) for p in os.environ["AZURE_STORAGE_CONNECTION_STRING"].split(";") if p)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=nobody;AccountKey=bm9ib2R5")
    options = {"account_name": servers.AZURITE_ACCOUNT, "account_key": servers.AZURITE_KEY}
    _round_trip(az_url, {**options, "endpoint": endpoint["BlobEndpoint"], "allow_http": True})
