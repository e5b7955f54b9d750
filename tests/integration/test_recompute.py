"""Gradient recomputation (model.recompute): same layers, same weights, same gradients as the plain model."""

import numpy as np
import pytest

from bigmem_train.config import config_from_dict

pytestmark = pytest.mark.slow


def _weight_key(path: str) -> str:
    # "down0/down0_conv1/kernel" (recomputed block) and "down0_conv1/kernel" (plain) -> "down0_conv1/kernel"
    return "/".join(path.split("/")[-2:])


def test_recomputed_model_matches_plain_model_and_saves():
    import keras
    import tensorflow as tf

    from bigmem_train.model.unet import RecomputedBlock, build_unet, make_loss

    configs = {
        flag: config_from_dict(
            {
                "data": {"input_shape": [16, 16, 8]},
                # Recomputed blocks build the unfolded layers (upconv.folds_level): compare with those.
                "model": {"depth": 2, "base_filters": 4, "recompute": flag, "fold_upsampling": False},
            }
        )
        for flag in (False, True)
    }
    keras.utils.set_random_seed(0)
    plain = build_unet(configs[False].model, (16, 16, 8), 1)
    recomputed = build_unet(configs[True].model, (16, 16, 8), 1)
    blocks = [layer.name for layer in recomputed.layers if isinstance(layer, RecomputedBlock)]
    assert blocks == ["down0", "down1", "bottom", "up1", "up0"]
    plain_weights = {_weight_key(w.path): w for w in plain.weights}
    assert sorted(plain_weights) == sorted(_weight_key(w.path) for w in recomputed.weights)
    for weight in recomputed.weights:
        weight.assign(plain_weights[_weight_key(weight.path)].numpy())

    rng = np.random.default_rng(0)
    x = rng.random((2, 16, 16, 8, 1), dtype=np.float32)
    y = (x > 0.7).astype(np.float32)
    loss = make_loss()

    def loss_and_gradients(model):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return value, tape.gradient(value, model.trainable_weights)

    def gradients(model, run=loss_and_gradients):
        value, grads = run(model)
        return float(value), {_weight_key(w.path): g.numpy() for w, g in zip(model.trainable_weights, grads)}

    plain_loss, plain_grads = gradients(plain)
    # Eagerly, and in a graph as Keras' fit runs it.
    for run in (loss_and_gradients, tf.function(loss_and_gradients)):
        recomputed_loss, recomputed_grads = gradients(recomputed, run)
        assert recomputed_loss == pytest.approx(plain_loss, rel=1e-5)
        for key, grad in plain_grads.items():
            np.testing.assert_allclose(recomputed_grads[key], grad, rtol=1e-4, atol=1e-6)


def test_recomputed_model_saves_and_reloads(tmp_path):
    import keras

    from bigmem_train.model.unet import compile_model

    config = config_from_dict(
        {
            "data": {"input_shape": [16, 16, 8]},
            "model": {"depth": 2, "base_filters": 4, "recompute": True},
            "training": {"batch_size": 2},
        }
    )
    model = compile_model(config)
    x = np.random.default_rng(1).random((2, 16, 16, 8, 1), dtype=np.float32)
    model.fit(x, (x > 0.7).astype(np.float32), epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras", compile=False)
    np.testing.assert_allclose(reloaded(x).numpy(), model(x).numpy(), atol=1e-6)
