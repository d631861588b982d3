"""The keys file (``hotwire_api.keys``) and ``hotwire keys``: what is written, what is refused, and what a running
:class:`KeyRing` sees after each edit. The routes and steering under roles are tested against a real ``vllm serve``
in tests/integration/test_roles.py."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from hotwire_api import cli, keys
from hotwire_api.json_file import LOOK_S
from hotwire_api.keys import KeyRing, KeysFileError, Role, add_key, hash_key, read_keys, revoke_key, rotate_key
from hotwire_core.error_codes import ErrorCode


def test_roles_are_ordered() -> None:
    assert Role.ADMIN.allows(Role.STEER) and Role.ADMIN.allows(Role.READ) and Role.STEER.allows(Role.READ)
    assert not Role.READ.allows(Role.STEER) and not Role.STEER.allows(Role.ADMIN)
    assert all(role.allows(role) for role in Role)


def test_the_file_keeps_hashes_only_and_edits_are_whole(tmp_path) -> None:
    path = tmp_path / "keys.json"
    ops = add_key(path, "ops", Role.ADMIN)
    app = add_key(path, "app-a", Role.STEER)
    assert ops.startswith("hw_") and len(ops) > 40 and ops != app
    text = path.read_text()
    assert ops not in text and app not in text and hash_key(ops) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [(k.name, k.role) for k in read_keys(path)] == [("ops", Role.ADMIN), ("app-a", Role.STEER)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.json.lock"]  # no temporary file left

    new = rotate_key(path, "app-a")
    keys = {k.name: k for k in read_keys(path)}
    assert keys["app-a"].sha256 == hash_key(new) != hash_key(app) and keys["app-a"].role is Role.STEER
    revoke_key(path, "ops")
    assert [k.name for k in read_keys(path)] == ["app-a"]


@pytest.mark.parametrize("edit, message", [
    (lambda p: add_key(p, "ops", Role.READ), "'ops' is in"),
    (lambda p: rotate_key(p, "nobody"), "no key named 'nobody'"),
    (lambda p: revoke_key(p, "nobody"), "no key named 'nobody'"),
    (lambda p: add_key(p, "bad name", Role.READ), "1-64 letters"),
])
def test_edits_that_cannot_be_made_change_nothing(tmp_path, edit, message) -> None:
    path = tmp_path / "keys.json"
    add_key(path, "ops", Role.ADMIN)
    before = path.read_bytes()
    with pytest.raises(KeysFileError, match=message):
        edit(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("text, message", [
    ("not json", "is not valid"),
    ('{"keys": [{"name": "a", "role": "root", "sha256": "' + "0" * 64 + '"}]}', "keys.0.role"),
    ('{"keys": [{"name": "a", "role": "read", "sha256": "abc"}]}', "keys.0.sha256"),
    ('{"keys": [{"name": "a", "role": "read", "sha256": "' + "0" * 64 + '", "secret": "x"}]}', "keys.0.secret"),
    ('{"keys": [{"name": "a", "role": "read", "sha256": "' + "0" * 64 + '"}, {"name": "a", "role": "read", "sha256": "'
     + "1" * 64 + '"}]}', "same name 'a'"),
    ('{"keys": [{"name": "a", "role": "read", "sha256": "' + "0" * 64 + '"}, {"name": "b", "role": "admin", "sha256": "'
     + "0" * 64 + '"}]}', "are the same key"),
])
def test_a_file_that_is_not_a_keys_file_is_refused_with_where(tmp_path, text, message) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(KeysFileError, match=message) as refused:
        read_keys(path)
    assert str(path) in str(refused.value)
    with pytest.raises(KeysFileError, match=message):
        KeyRing(path)  # the server does not start on it
    with pytest.raises(KeysFileError, match="cannot be read"):
        KeyRing(tmp_path / "missing.json")


def test_a_ring_follows_every_edit_and_a_broken_file_opens_nothing(tmp_path) -> None:
    path = tmp_path / "keys.json"
    ops = add_key(path, "ops", Role.ADMIN)
    ring = KeyRing(path)
    assert ring.identify(ops).name == "ops" and ring.identify("hw_guess") is None
    assert ring.identify("") is None and ring.identify(None) is None
    app = add_key(path, "app", Role.STEER)  # another process's edit: in force within LOOK_S, no restart
    time.sleep(LOOK_S)
    assert ring.identify(app).role is Role.STEER
    rotated = rotate_key(path, "app")
    time.sleep(LOOK_S)
    assert ring.identify(app) is None and ring.identify(rotated).name == "app"
    revoke_key(path, "app")
    time.sleep(LOOK_S)
    assert ring.identify(rotated) is None and ring.error is None

    path.write_text("{")  # an edit by hand gone wrong: nothing opens, and the ring says why
    time.sleep(LOOK_S)
    assert ring.identify(ops) is None and "is not valid" in ring.error
    path.unlink()
    time.sleep(LOOK_S)
    assert ring.identify(ops) is None and "cannot be read" in ring.error
    again = add_key(path, "ops", Role.ADMIN)
    time.sleep(LOOK_S)
    assert ring.identify(again).name == "ops" and ring.error is None and ring.identify(ops) is None


def test_a_ring_looks_at_the_file_once_per_interval_and_its_own_edits_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(keys, "LOOK_S", 60.0)  # an interval no slow machine outlasts
    path = tmp_path / "keys.json"
    ops = add_key(path, "ops", Role.ADMIN)
    ring = KeyRing(path)
    path.unlink()  # unseen until the next look
    assert ring.identify(ops).name == "ops" and ring.error is None
    with ring.editing("app", "ops"):  # an edit through the ring (the /steer/keys routes): in force at once
        app = add_key(path, "app", Role.STEER)
    assert ring.identify(app).name == "app" and ring.identify(ops) is None


def test_extra_keys_open_whatever_the_file_says(tmp_path) -> None:
    from hotwire_api.keys import Key

    path = tmp_path / "keys.json"
    add_key(path, "ops", Role.READ)
    ring = KeyRing(path, (Key(name="HOTWIRE_API_KEY", role=Role.ADMIN, sha256=hash_key("env-key")),))
    path.write_text("broken")
    time.sleep(LOOK_S)
    assert ring.identify("env-key").role is Role.ADMIN and ring.error is not None


def test_the_cli_edits_the_file_and_prints_the_key_once(tmp_path, capsys, monkeypatch) -> None:
    path = tmp_path / "keys.json"
    monkeypatch.setenv("HOTWIRE_KEYS_FILE", str(path))
    assert cli.main(["keys", "add", "ops", "--role", "admin"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert added["name"] == "ops" and added["role"] == "admin" and KeyRing(path).identify(added["key"]).name == "ops"
    assert cli.main(["keys", "--file", str(path), "add", "app", "--role", "steer", "--tenant", "acme"]) == 0
    assert json.loads(capsys.readouterr().out)["tenant"] == "acme"
    assert cli.main(["keys", "list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(k["name"], k["role"], k["tenant"]) for k in listed] == [("ops", "admin", None), ("app", "steer", "acme")]
    assert all("sha256" not in k and "key" not in k for k in listed)
    assert cli.main(["keys", "rotate", "ops"]) == 0
    rotated = json.loads(capsys.readouterr().out)["key"]
    assert KeyRing(path).identify(rotated).name == "ops" and KeyRing(path).identify(added["key"]) is None
    assert cli.main(["keys", "revoke", "app"]) == 0 and json.loads(capsys.readouterr().out)["revoked"] is True

    assert cli.main(["keys", "revoke", "app"]) == 2 and "no key named 'app'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_role:
        cli.main(["keys", "add", "x", "--role", "root"])
    assert bad_role.value.code == 2 and "invalid choice: 'root'" in capsys.readouterr().err
    monkeypatch.delenv("HOTWIRE_KEYS_FILE")
    assert cli.main(["keys", "list"]) == 2 and "pass --file or set HOTWIRE_KEYS_FILE" in capsys.readouterr().err


def test_a_ring_lists_what_each_valid_edit_changed(tmp_path) -> None:
    path = tmp_path / "keys.json"
    add_key(path, "ops", Role.ADMIN)
    ring = KeyRing(path)
    assert ring.changes == []  # the first read is no change
    add_key(path, "app", Role.STEER)
    ring.refresh()
    rotate_key(path, "app")
    ring.refresh()
    with ring.editing("app", "ops"):  # an edit over HTTP names its caller
        rotate_key(path, "app")
    assert ring.changes == [("key_added", "app", "keys file"), ("key_rotated", "app", "keys file"),
                            ("key_rotated", "app", "ops")]
    ring.changes.clear()

    saved = path.read_text()
    path.write_text("{")  # broken, then mended with one key revoked and one given another role
    ring.refresh()
    keys = json.loads(saved)
    keys["keys"] = [dict(k, role="read") for k in keys["keys"] if k["name"] == "ops"]
    path.write_text(json.dumps(keys))
    ring.refresh()
    assert ring.changes == [("key_role_changed", "ops", "keys file"), ("key_revoked", "app", "keys file")]


def test_edits_from_many_processes_at_once_are_all_kept(tmp_path) -> None:
    """The lock beside the file: concurrent adds (the CLI, several API servers) each read the others' result."""
    import multiprocessing

    path = tmp_path / "keys.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.starmap(add_key, [(path, f"k{n}", Role.STEER) for n in range(24)])
    assert sorted(key.name for key in read_keys(path)) == sorted(f"k{n}" for n in range(24))


def test_the_last_admin_key_is_kept_when_asked(tmp_path) -> None:
    path = tmp_path / "keys.json"
    add_key(path, "ops", Role.ADMIN)
    add_key(path, "app", Role.STEER)
    with pytest.raises(KeysFileError, match="last admin key") as refused:
        revoke_key(path, "ops", keep_an_admin=True)
    assert refused.value.code is ErrorCode.LAST_ADMIN
    revoke_key(path, "app", keep_an_admin=True)
    add_key(path, "ops2", Role.ADMIN)
    revoke_key(path, "ops", keep_an_admin=True)
    revoke_key(path, "ops2")  # the CLI's operator may empty the file
    assert read_keys(path) == []
