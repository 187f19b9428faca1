"""`turnrl serve` on a run directory: the checkpoint's LoRA adapter is merged into the engine's weights."""

import asyncio

import openai
import pytest
import torch

from turnrl.cli import main
from turnrl.config import dump_yaml, load_config
from turnrl.gateway.serve import build_gateway, resolve_target
from turnrl.gateway.server import check_host
from turnrl.train.checkpoint import save_checkpoint
from turnrl.train.policy import export_weights, load_policy
from tests.gateway.conftest import served


def test_serving_a_lora_run_dir_loads_the_merged_adapter(tmp_path, smollm2_dir, torch_threads):
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", "engine.max_batch_size=4",
                             f"output_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    policy = load_policy(str(smollm2_dir), torch.device("cpu"), 4, 8.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)   # a trained adapter: B is no longer zero
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    save_checkpoint(tmp_path / "checkpoints", 3, policy, optimizer, scheduler, torch.Generator(), {"data_position": 0})
    expected = dict(export_weights(policy))
    name = next(iter(expected))

    served_run = resolve_target(str(tmp_path), [], None, None)
    assert served_run.model_name == tmp_path.name and served_run.checkpoint.name == "step_000003"

    async def go():
        with torch_threads(1):
            gateway, engine = await build_gateway(served_run)
        try:
            loaded = engine.model.state_dict()[name]
            async with served(gateway) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
                r = await client.chat.completions.create(model=tmp_path.name, max_tokens=4,
                                                         messages=[{"role": "user", "content": "Hi"}])
            return loaded, r
        finally:
            await engine.close()

    loaded, reply = asyncio.run(go())
    assert torch.allclose(loaded.float(), expected[name].float(), atol=1e-2)   # bf16 engine weights
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_serve_refuses_remote_hosts_unless_asked(tmp_path, capsys):
    with pytest.raises(ValueError, match="allow-remote"):
        check_host("0.0.0.0", allow_remote=False)
    check_host("0.0.0.0", allow_remote=True)
    check_host("::1", allow_remote=False)
    with pytest.raises(SystemExit, match="allow-remote"):
        main(["serve", str(tmp_path), "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="without config.yaml"):
        main(["serve", str(tmp_path)])
