from worker.models.spec import KindShape, LayerKind, ModelSpec


def _spec(kinds: str, window: int | None = 7) -> ModelSpec:
    shape = KindShape(num_q_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)
    return ModelSpec(
        architecture="test",
        layer_kinds=tuple(LayerKind.SWA if c == "s" else LayerKind.FULL for c in kinds),
        window=window,
        full=shape,
        swa=KindShape(num_q_heads=4, num_kv_heads=1, head_dim=16, v_head_dim=8),
        vocab_size=256,
        hidden_size=64,
        max_position_embeddings=1024,
    )


def test_layer_index_numbers_each_kind_separately() -> None:
    spec = _spec("sfsf")
    assert spec.full_layer_ids == (1, 3)
    assert spec.swa_layer_ids == (0, 2)
    assert spec.layer_index == (
        (LayerKind.SWA, 0),
        (LayerKind.FULL, 0),
        (LayerKind.SWA, 1),
        (LayerKind.FULL, 1),
    )
    assert spec.is_hybrid and not spec.is_all_swa


def test_kv_bytes_per_token_uses_each_kinds_shape() -> None:
    spec = _spec("sf")
    assert spec.kv_bytes_per_token(LayerKind.FULL, 2) == 2 * 32 * 2
    assert spec.kv_bytes_per_token(LayerKind.SWA, 2) == 1 * 24 * 2


def test_swa_layers_without_window_are_rejected() -> None:
    import pytest

    with pytest.raises(ValueError, match="window"):
        _spec("sf", window=None)
