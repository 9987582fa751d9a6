"""Prompt rows with images (data/images.py) through the tiny Qwen2.5-VL's own image processor and tokenizer:
paths and data URLs read, placeholders expanded to the images' tokens; a missing or unreadable image (or a
placeholder count that does not match) is a failed row naming the file, the other rows kept; the encoded rows as
a policy batch give transformers' log-probs on the same processor output. Cost: ~10 s CPU (one process).
"""

import base64

import pytest
import torch

from tests.support import qwen2_5_vl_tiny as tiny

pytestmark = pytest.mark.core  # the policy forward runs megatron-core

IMAGE = tiny.IMAGE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.save_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl_images") / "tiny")



def _rows(tmp_path) -> list[dict]:
    (tmp_path / "wide.png").write_bytes(tiny.random_png(16, 24, 0))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    url = "data:image/png;base64," + base64.b64encode(tiny.random_png(24, 16, 1)).decode()
    return [{"prompt": f"t5 t6 {IMAGE} t7", "images": ["wide.png"]},
            {"prompt": f"t5 {IMAGE}", "images": "missing.png"},
            {"prompt": f"t8 {IMAGE} t9 {IMAGE} t33", "images": [url, "wide.png"]},
            {"prompt": f"t5 {IMAGE}", "images": ["bad.png"]},
            {"prompt": "t5 t9 t34"},
            {"prompt": f"t5 {IMAGE} {IMAGE}", "images": ["wide.png"]}]


def test_rows_with_images_encode_and_failed_rows_are_counted(checkpoint, tmp_path):
    from megatron_rl.data.images import ImageEncoder, encode_rows

    encoder = ImageEncoder.from_checkpoint(checkpoint)
    kept, failed = encode_rows(_rows(tmp_path), encoder, prompt_key="prompt", image_key="images", base_dir=tmp_path)
    assert [p.row for p in kept] == [0, 2, 4] and [row for row, _ in failed] == [1, 3, 5]
    assert "'missing.png'" in failed[0][1] and "'bad.png'" in failed[1][1] and "2 image placeholders" in failed[2][1]
    first, both, text = kept
    assert first.image_grid_thw.tolist() == [[1, 4, 6]]  # 16 x 24 pixels, patch 4
    assert first.input_ids == [5, 6, tiny.VISION_START] + [tiny.IMAGE_TOKEN] * 6 + [tiny.VISION_END, 7]
    assert both.image_grid_thw.tolist() == [[1, 6, 4], [1, 4, 6]] and both.pixel_values.shape == (48, 96)
    assert both.input_ids.count(tiny.IMAGE_TOKEN) == 12 and text.input_ids == [5, 9, 34]


def test_encoded_rows_as_a_policy_batch_match_transformers(groups, checkpoint, tmp_path):
    from megatron_rl.data.batch import left_pad
    from megatron_rl.data.images import ImageEncoder, encode_rows
    from megatron_rl.data.mrope import batch_images, mrope_positions, row_images
    from tests.support.batches import training_batch

    kept, _ = encode_rows(_rows(tmp_path), ImageEncoder.from_checkpoint(checkpoint), prompt_key="prompt",
                          image_key="images", base_dir=tmp_path)
    responses = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
    seqs = [p.input_ids + r for p, r in zip(kept, responses)]
    ids, mask = left_pad(seqs, 0)
    width = max(map(len, responses))
    response_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in responses])
    images = [list(zip(torch.split(p.pixel_values, p.image_grid_thw.prod(-1).tolist()), p.image_grid_thw.tolist()))
              for p in kept]
    pixel_values, image_grid_thw = batch_images(images)
    tensors = dict(sequences=ids, attention_mask=mask, response_mask=response_mask,
                   loss_mask=response_mask.float(), pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    got = tiny.vl_policy(checkpoint, groups).forward(training_batch(tensors))["logprobs"]
    rows = [(p.input_ids, [tuple(g) for g in p.image_grid_thw.tolist()], len(r)) for p, r in zip(kept, responses)]
    pixels = [p.pixel_values if len(p.image_grid_thw) else None for p in kept]
    _, grids = row_images(pixel_values, image_grid_thw)
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)
    want = tiny.transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
    assert (got - want)[response_mask.bool()].abs().max() < 1e-5


def test_a_long_missing_path_is_named_by_its_file_not_read_as_base64(tmp_path):
    """A path over 64 characters that does not exist (CI's deep temporary folders) says 'no such file' and keeps
    its file name in the message (it was once decoded as base64 and cut after 60 characters)."""
    from megatron_rl.data.images import ImageError, read_image

    deep = tmp_path / ("d" * 80) / "missing.png"
    with pytest.raises(ImageError, match=r"missing\.png'.*no such file"):
        read_image(str(deep))
    url = "data:image/png;base64," + __import__("base64").b64encode(tiny.random_png(8, 8, 0)).decode()
    assert read_image(url.split(",", 1)[1]).size == (8, 8)  # raw base64 (no suffix, no path prefix) still reads
