"""`dagster-webserver -w workspace.yaml` loads the code location and lists the asset graph, as a person opening the
UI sees it."""

from tests.support.dagster_procs import ARTIFACTS, LOCATION_STATUS, webserver


def test_webserver_loads_the_code_location_and_lists_the_graph(tmp_path):
    with webserver(tmp_path, log_dir=ARTIFACTS / "logs" / "webserver") as server:
        entries = server.gql(LOCATION_STATUS)["workspaceOrError"]["locationEntries"]
        nodes = server.gql(
            "{ assetNodes { assetKey { path } partitionDefinition { type } "
            "assetChecksOrError { ... on AssetChecks { checks { name blocking } } } } }"
        )["assetNodes"]
    assert [(e["name"], e["locationOrLoadError"]["__typename"]) for e in entries] == [
        ("dflash_assets", "RepositoryLocation")
    ]
    by_key = {n["assetKey"]["path"][0]: n for n in nodes}
    assert set(by_key) == {
        "prompt_shards",
        "completions",
        "continued_completions",
        "length_quality_report",
        "length_quality_summary",
        "drafter_training_set",
        "length_probe",
    }
    assert {by_key[k]["partitionDefinition"]["type"] for k in ("prompt_shards", "completions")} == {"DYNAMIC"}
    checks = {c["name"]: c["blocking"] for c in by_key["length_quality_report"]["assetChecksOrError"]["checks"]}
    assert checks["truncation_rate"] is True and checks["context_overflow"] is True
