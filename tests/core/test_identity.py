from gpusd.identity import node_id


def test_node_id_is_stable_per_state_directory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    first = node_id(a)
    assert node_id(a) == first  # across restarts
    assert node_id(b) != first  # two daemons side by side differ
    assert len(first) == 16 and int(first, 16) >= 0


def test_damaged_node_id_file_is_replaced(tmp_path):
    (tmp_path / "node-id").write_bytes(b"\xff\xfe" + b"x" * 5000)
    new = node_id(tmp_path)
    assert len(new) == 16 and int(new, 16) >= 0
    assert (tmp_path / "node-id").read_text().strip() == new
