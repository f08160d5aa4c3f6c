"""The catalogue of bad inputs run by `scripts/bad_inputs.py` (and `tests/test_bad_inputs.py`): data, no logic.

Every case is a careless or hostile use of one surface (a command, a public constructor or loader) that must be
refused: one line naming `needle` (the argument, or the file), exit status 2 (a `ValueError`/`TypeError` or one of
ssogvit's errors for the Python API), nothing written, nothing changed. The cases use only what every version of
ssogvit has (the command line and the public API), so the same catalogue runs against any checkout.

Placeholders in a case: `{run}` a finished tiny training run, `{ckpt}` its best.ckpt, `{last}` its last.ckpt,
`{export}` its model.safetensors, `{saved}` a `save_pretrained` folder, `{teacher}` an MHA export for `convert`,
`{images}` a folder of images, `{file}` a plain file, `{ro}` a read-only folder, `{tmp}` the case's own fresh folder
(also its working directory), and the damaged or hostile files of `FILES`. In `code`, `TINY` is the keyword arguments
of a tiny model and `P` the placeholders' paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Case", "CASES", "FILES", "TINY_RUN", "TINY_CONVERT", "KINDS"]

#: the classes of bad input
KINDS = ("missing", "existing", "read-only", "file-for-folder", "type", "range", "unknown", "huge", "malicious",
         "truncated", "bit-flipped", "ignored")


@dataclass(frozen=True)
class Case:
    """One bad input. Exactly one of `argv` (the command line, without `ssogvit`) and `code` (a Python expression
    over the public API) is set;"""

    surface: str
    kind: str
    needle: str
    argv: tuple[str, ...] | None = None
    code: str | None = None
    subprocess: bool = False  # run in a child process even in the fast (in-process) mode: it may change the process
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        what = " ".join(self.argv) if self.argv is not None else self.code
        return f"{self.surface}: {what}"


#: a seconds-long training run (1 block, width 32, 16 px synthetic images)
TINY_RUN = ("data=synthetic", "data.img_size=16", "data.train_size=32", "data.val_size=16", "data.batch_size=16",
            "model=vit", "model.size=tiny", "model.mixer=ssog", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2",
            "model.kwargs.depth=1", "model.kwargs.patch_size=4", "trainer.max_epochs=1",
            "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "trainer.devices=1",
            "ckpt.every_n_train_steps=null", "logger=[csv]")
#: a seconds-long conversion of `{teacher}` on the digits
TINY_CONVERT = ("data.img_size=16", "data.batch_size=16", "data.num_workers=0", "trainer.max_epochs=1",
                "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.accelerator=cpu",
                "trainer.enable_progress_bar=false", "convert.fit_steps=2", "convert.calib_images=4", "logger=[csv]")

#: damaged or hostile files the fixtures make (name -> what it is), used as placeholders
FILES = {
    "torn": "best.ckpt cut to its first 5000 bytes",
    "empty": "an empty .ckpt",
    "text": "a .ckpt holding text",
    "evil": "a .ckpt whose pickle runs os.system",
    "flipped": "last.ckpt with 64 random bytes inside its optimizer state (a copy of the run)",
    "flipped_export": "model.safetensors with 64 random bytes inside a weight",
    "torn_export": "model.safetensors cut to 100 bytes",
    "nan_ckpt": "a checkpoint whose weights hold NaN",
    "big_cfg_ckpt": "a checkpoint whose model_config asks for embed_dim=65536",
    "bomb_run": "a run folder whose config.yaml is a YAML alias bomb",
    "env_run": "a run folder whose config.yaml holds ${oc.env:HOME}",
    "huge_saved": "a save_pretrained folder whose config.json asks for a 17 GB model",
    "foreign_saved": "a save_pretrained folder whose config.json names timm's vit_huge_patch14_224",
    "env_saved": "a save_pretrained folder whose config.json holds ${oc.env:HOME}",
    "fat_saved": "a save_pretrained folder with a 20 GB (sparse) model.safetensors",
    "lock_run": "a fresh folder holding a .ssogvit.lock and a .lock that are not ssogvit's",
    "torn_csv_run": "a run folder whose metrics.csv is binary garbage",
    "unfinished": "an unfinished copy of the run (run.json running)",
    "analysis": "a folder holding the user's own atoms.json, atoms.md and atoms.png",
    "report_out": "a folder holding the user's own runs.md and curves.png",
}


def _cli(surface: str, kind: str, needle: str, *argv: str, sub: bool = False) -> Case:
    return Case(surface, kind, needle, argv=tuple(argv), subprocess=sub)


def _api(surface: str, kind: str, needle: str, code: str) -> Case:
    return Case(surface, kind, needle, code=code)


def _model_cases() -> list[Case]:
    cm = "create_model('vit-tiny-ssog', **dict(TINY, {}))"
    bad = [("img_size=224.5", "type"), ("img_size=224.0", "type"), ("img_size='224'", "type"),
           ("img_size=True", "type"), ("img_size=0", "range"), ("img_size=-16", "range"), ("img_size=(16, 16.5)", "type"),
           ("img_size=[16]", "type"),
           ("img_size=None", "type"), ("patch_size=0", "range"), ("patch_size=2.5", "type"), ("patch_size='4'", "type"),
           ("drop_path_rate=5", "range"), ("drop_path_rate=-0.1", "range"), ("drop_path_rate=float('nan')", "range"),
           ("drop_path_rate='0.1'", "type"), ("num_classes=-1", "range"), ("num_classes=1.5", "type"),
           ("num_classes='10'", "type"), ("num_classes=10**9", "range"), ("depth=0", "range"), ("depth=2.5", "type"),
           ("depth=True", "type"), ("embed_dim=0", "range"), ("embed_dim=32.0", "type"), ("num_heads=0", "range"),
           ("num_heads=2.0", "type"), ("in_chans=0", "range"), ("in_chans=1.5", "type"), ("num_registers=-1", "range"),
           ("num_registers=0.5", "type"), ("mlp_ratio=0", "range"), ("mlp_ratio=-1", "range"),
           ("mlp_ratio=float('inf')", "range"), ("mlp_ratio='4'", "type"), ("global_pool='max'", "unknown"),
           ("global_pool=1", "type"), ("num_atoms=0", "range"), ("num_atoms=2.5", "type"), ("radius=0", "range"),
           ("radius=-1", "range"), ("radius=float('nan')", "range"), ("sigma_min=0", "range"),
           ("impl='fft'", "unknown"), ("head_chunk=0", "range"), ("gate_init='x'", "ignored"), ("bogus=1", "unknown"),
           ("radius=2", "ignored"), ("gate_init=-2.0", "ignored")]  # radius, gate_init: steering options
    cases = [_api("create_model", kind, arg.split("=")[0], cm.format(arg)) for arg, kind in bad]
    cases += [
        _api("create_model", "unknown", "vit-huge-ssog", "create_model('vit-huge-ssog')"),
        _api("create_model", "type", "123", "create_model(123)"),
        _api("create_model", "huge", "embed_dim", "create_model('vit-base-ssog', embed_dim=8192, num_heads=8, "
             "depth=512)"),
        _api("create_model", "unknown", "steer", "create_model('vit-tiny-ssog-steered', **dict(TINY, steer='tau'))"),
        _api("create_model", "type", "gate_init", "create_model('vit-tiny-ssog-steered', **dict(TINY, gate_init='x'))"),
        _api("create_model", "range", "global_blocks",
             "create_model('vit-tiny-window', **dict(TINY, global_blocks=(9,)))"),
        _api("create_model", "type", "global_blocks", "create_model('vit-tiny-window', **dict(TINY, global_blocks=1))"),
        _api("create_model", "unknown", "global_blocks",
             "create_model('looped-tiny-window', **dict(TINY, global_blocks=(0,)))"),
    ]
    seg = "create_model('vit-tiny-ssog', task='segmentation', **dict(TINY, num_classes=3, {}))"  # docs/dense.md
    for arg, kind, needle in [("pyramid_dim=0", "range", "pyramid_dim"), ("head_dim=1.5", "type", "head_dim"),
                              ("feature_blocks=[0, 1]", "range", "feature_blocks"),
                              ("feature_blocks='0,1,2,3'", "type", "feature_blocks")]:
        cases.append(_api("create_model", kind, needle, seg.format(arg)))
    cases.append(_api("create_model", "unknown", "detection", "create_model('vit-tiny-ssog', task='detection')"))
    ode = "create_model('ode-tiny-ssog', **dict(TINY, {}))"
    for arg, kind in [("solver='bogus'", "unknown"), ("rtol=0", "range"), ("atol=-1", "range"), ("scale=0", "range"),
                      ("adjoint='yes'", "type"), ("norm=5", "type"), ("drop_path_rate=0.1", "range"),
                      ("rtol=0.01", "ignored"), ("atol=0.001", "ignored")]:  # tolerances of adaptive solvers only
        cases.append(_api("ode family", kind, arg.split("=")[0], ode.format(arg)))
    return cases


def _mixer_cases() -> list[Case]:
    cases = [_api("create_mixer", kind, needle, f"create_mixer({args})") for args, kind, needle in [
        ("'ssog', 0, 4", "range", "dim"), ("'ssog', 16, 0", "range", "num_heads"),
        ("'ssog', 16, 2.0", "type", "num_heads"),
        ("'ssog', 16.0, 2", "type", "dim"), ("'ssog', '16', 2", "type", "dim"), ("'ssog', -16, 2", "range", "dim"),
        ("'ssog', 10, 3", "range", "num_heads"), ("'flash', 16, 2", "unknown", "flash"),
        ("None, 16, 2", "type", "mixer"),
        ("'mha', 16, 2, attn_drop=1.5", "range", "attn_drop"), ("'mha', 16, 2, attn_drop=-1", "range", "attn_drop"),
        ("'mha', 16, 2, fused='yes'", "type", "fused"), ("'ssog', 16, 2, proj_drop=2", "range", "proj_drop"),
        ("'ssog-steered', 16, 2, steer=()", "range", "steer"),
        ("'ssog', 16, 2, prefix_pool='max'", "unknown", "prefix_pool"),
        ("'ssog', 16, 2, bias='no'", "type", "bias"), ("'ssog', 16, 2, num_atoms=1025", "range", "num_atoms"),
        ("'ssog', 16, 2, tau_min=-1", "range", "tau_min"), ("'ssog', 16, 2, mu_init_std=-1", "range", "mu_init_std"),
        ("'mha', 16, 2, num_atoms=4", "unknown", "num_atoms"),
        ("'window', 16, 2, window_size=0", "range", "window_size"), ("'window', 16, 2, window_size=2.5", "type",
                                                                      "window_size"),
        ("'window', 16, 2, window_size=4, shift_size=4", "range", "shift_size"),
        ("'neighborhood', 16, 2, kernel_size=4", "range", "kernel_size"),
        ("'neighborhood', 16, 2, impl='natten'", "unknown", "impl"),
        ("'neighborhood', 16, 2, impl='flex', attn_drop=0.1", "range", "attn_drop"),
        ("'linear', 16, 2, attn_drop=0.1", "unknown", "attn_drop"),
    ]]
    cases += [
        _api("SSoGAttention", "range", "num_atoms", "SSoGAttention(16, 2, num_atoms=-1)"),
        _api("SSoGAttention", "type", "dim", "SSoGAttention(16.5, 2)"),
        _api("Attention", "range", "dim", "Attention(0, 1)"),
        _api("Attention", "type", "qkv_bias", "Attention(16, 2, qkv_bias=1)"),
    ]
    call = "create_mixer({!r}, 16, 2)(torch.randn(1, 17, 16), grid={})"
    for name in ("ssog", "ssog-steered", "mha", "window", "neighborhood", "linear"):
        cases += [
            _api("mixer call", "range", "grid", call.format(name, "(2, 2)")),  # 13 patches taken as prefix tokens
            _api("mixer call", "type", "grid", call.format(name, "(4.5, 4)")),
            _api("mixer call", "range", "grid", call.format(name, "(5, 5)")),
        ]
    cases += [
        _api("mixer call", "type", "x", "create_mixer('ssog', 16, 2)(torch.randn(17, 16), grid=(4, 4))"),
        _api("mixer call", "range", "dim", "create_mixer('ssog', 16, 2)(torch.randn(1, 17, 8), grid=(4, 4))"),
        _api("mixer call", "missing", "grid", "create_mixer('ssog', 16, 2)(torch.randn(1, 17, 16))"),
    ]
    sg = "ssogify(timm.create_model('vit_tiny_patch16_224', num_classes=3, img_size=32, depth=1), {})"
    cases += [_api("ssogify", kind, needle, sg.format(arg)) for arg, kind, needle in [
        ("mixer='mha'", "unknown", "mixer"), ("mixer='foo'", "unknown", "mixer"), ("copy_weights='yes'", "type",
                                                                                   "copy_weights"),
        ("num_atoms=0", "range", "num_atoms"), ("radius=-1", "range", "radius"), ("bias=False", "unknown", "bias"),
        ("steer='mu'", "unknown", "steer"), ("gate_init=float('nan')", "ignored", "gate_init"),
        ("mixer='ssog-steered', gate_init=float('nan')", "range", "gate_init"), ("radius=2", "ignored", "radius"),
    ]]
    cases.append(_api("ssogify", "type", "ssogify", "ssogify(create_mixer('mha', 16, 2))"))
    return cases


def _loader_cases() -> list[Case]:
    lm = "load_model(P[{!r}]{})"
    cases = [_api("load_model", kind, needle, lm.format(key, extra)) for key, extra, kind, needle in [
        ("export", ", use_ema=True", "unknown", "use_ema"), ("ckpt", ", map_location='cuda'", "unknown", "cuda"),
        ("ckpt", ", map_location='gpu'", "unknown", "gpu"), ("run", "", "file-for-folder", "is a folder"),
        ("missing", "", "missing", "does not exist"), ("torn", "", "truncated", "torn.ckpt"),
        ("flipped", "", "bit-flipped", "last.ckpt"), ("flipped_export", "", "bit-flipped", "model.safetensors"),
        ("torn_export", "", "truncated", "model.safetensors"), ("text", "", "truncated", "text.ckpt"),
        ("evil", "", "malicious", "evil.ckpt"), ("nan_ckpt", "", "range", "non-finite"),
        ("big_cfg_ckpt", "", "huge", "embed_dim"), ("empty", "", "truncated", "empty.ckpt"),
    ]]
    fp = "from_pretrained(P[{!r}])"
    cases += [_api("from_pretrained", kind, needle, fp.format(key)) for key, kind, needle in [
        ("missing", "missing", "missing"), ("file", "file-for-folder", "file"), ("huge_saved", "huge", "embed_dim"),
        ("foreign_saved", "malicious", "architecture"), ("env_saved", "malicious", "interpolation"),
        ("fat_saved", "huge", "model.safetensors"),
    ]]
    td = "timm.create_model('local-dir:' + str(P[{!r}]), pretrained=True)"
    cases += [_api("timm local-dir", kind, needle, td.format(key)) for key, kind, needle in [
        ("huge_saved", "huge", "embed_dim"), ("env_saved", "malicious", "interpolation"),
        ("fat_saved", "huge", "model.safetensors"),
    ]]
    cases.append(_api("timm file overlay", "ignored", "depth", "timm.create_model('ssogvit_vit_tiny_ssog', "
                      "pretrained=True, pretrained_cfg_overlay=dict(file=str(P['export'])), depth=5)"))
    cases.append(_api("timm file overlay", "ignored", "pretrained", "timm.create_model('ssogvit_vit_tiny_ssog', "
                      "pretrained_cfg_overlay=dict(file=str(P['export'])))"))  # timm itself ignores the file
    cases.append(_api("timm file overlay", "ignored", "sigma_min", "timm.create_model('ssogvit_vit_tiny_ssog', "
                      "pretrained=True, pretrained_cfg_overlay=dict(file=str(P['export'])), sigma_min=0.5)"))
    cases.append(_api("rescale_field", "range", "factor_y",
                      "create_model('vit-tiny-ssog', **TINY).rescale_field(float('inf'), 1.0)"))
    cases.append(_api("timm pyramid", "range", "patch_size", "timm.create_model('ssogvit_vit_tiny_ssog_pyramid', "
                      "**dict(TINY, patch_size=2))"))
    dm = "create_datamodule('synthetic', {})"
    cases += [_api("datamodules", kind, needle, dm.format(arg)) for arg, kind, needle in [
        ("img_size=224.5", "type", "img_size"), ("img_size=0", "range", "img_size"),
        ("img_size=16, batch_size=0", "range", "batch_size"), ("img_size=16, batch_size=2.5", "type", "batch_size"),
        ("img_size=16, num_workers=-1", "range", "num_workers"), ("img_size=16, train_size=0", "range", "train_size"),
        ("img_size=16, num_classes=0", "range", "num_classes"), ("img_size=16, in_chans=0", "range", "in_chans"),
        ("img_size=16, learnable='yes'", "type", "learnable"),
    ]]
    cases += [
        _api("datamodules", "unknown", "nope", "create_datamodule('nope', img_size=16)"),
        _api("datamodules", "range", "val_fraction", "create_datamodule('digits', img_size=16, val_fraction=1.5)"),
        _api("datamodules", "range", "scale", "create_datamodule('digit_scenes', img_size=64, scale=[0.3, 0.1])"),
        _api("datamodules", "type", "digits_per_scene", "create_datamodule('digit_scenes', img_size=64, "
             "digits_per_scene=2.5)"),
        _api("datamodules", "range", "num_val_scenes", "create_datamodule('digit_scenes', img_size=64, "
             "num_val_scenes=0)"),
        _api("datamodules", "range", "ignore_index", "create_datamodule('segfolder', img_size=64, num_classes=3, "
             "ignore_index=1)"),
        _api("datamodules", "missing", "does not exist", "create_datamodule('segfolder', img_size=64, "
             "root='/nonexistent/seg', num_classes=3).prepare_data()"),
        _api("datamodules", "huge", "img_size", "next(iter(_setup(create_datamodule('synthetic', img_size=16000, "
             "batch_size=64)).train_dataloader()))"),
    ]
    return cases


def _train_cases() -> list[Case]:
    run = list(TINY_RUN)
    cases = []
    for override, kind, needle in [
        ("trainer.max_epochs=-5", "range", "trainer.max_epochs"),
        ("trainer.max_epochs=abc", "type", "trainer.max_epochs"),
        ("trainer.max_epochs=2.5", "type", "trainer.max_epochs"), ("data.batch_size=0", "range", "data.batch_size"),
        ("data.num_workers=-1", "range", "data.num_workers"), ("data.train_size=0", "range", "train_size"),
        ("data.in_chans=0", "range", "in_chans"), ("data.img_size=224.5", "type", "img_size"),
        ("data.img_size=100000", "huge", "img_size"), ("data.img_size=16384", "huge", "img_size"),
        ("optim.lr=nan", "range", "optim.lr"), ("optim.lr=-1", "range", "optim.lr"),
        ("optim.opt=nope", "unknown", "optim.opt"), ("seed=abc", "type", "seed"), ("seed=-1", "range", "seed"),
        ("trainer.precision=16-mixed", "unknown", "trainer.precision"),  # mixed precision on the CPU
        ("loss.jasmin.reduce=max", "ignored", "loss.jasmin.reduce"),  # softmax-jacobian's option
        ("sched.warmup_epochs=-1", "range", "sched.warmup_epochs"), ("loss.smoothing=2", "range", "loss.smoothing"),
        ("loss.jasmin.reduce=sum", "unknown", "loss.jasmin.reduce"),
        ("mixup.mixup_alpha=-1", "range", "mixup.mixup_alpha"),
        ("ema.decay=2", "range", "ema.decay"), ("ckpt.monitor=val/loss", "unknown", "ckpt.monitor"),
        ("ckpt.keep=-5", "range", "ckpt.keep"), ("ckpt.every_n_train_steps=-1", "range", "every_n_train_steps"),
        ("trainer.accumulate_grad_batches=0", "range", "accumulate_grad_batches"),
        ("trainer.gradient_clip_val=-1", "range", "gradient_clip_val"), ("trainer.devices=0", "range", "devices"),
        ("trainer.precision=foo", "unknown", "foo"), ("transfer.mode=bogus", "unknown", "transfer.mode"),
        ("model.kwargs.patch_size=5", "range", "patch_size 5"), ("model.kwargs.embed_dim=0", "range", "embed_dim"),
        ("model.kwargs.num_heads=3", "range", "num_heads"), ("model.kwargs.depth=0", "range", "depth"),
        ("model.size=huge", "unknown", "huge"), ("model.mixer=foo", "unknown", "foo"),
        ("+model.kwargs.drop_path_rate=5", "range", "drop_path_rate"), ("+model.kwargs.bogus=1", "unknown", "bogus"),
        ("+model.kwargs.num_atoms=2.5", "type", "num_atoms"), ("nonsense_key=1", "unknown", "nonsense_key"),
        ("data=nope", "unknown", "nope"), ("experiment=nope", "unknown", "nope"),
        ("just-a-word", "type", "just-a-word"),
        ("trainer.max_epochs=[1", "type", "max_epochs"), ("ema.enabled=maybe", "type", "ema.enabled"),
        ("trainer.max_steps=0", "range", "trainer.max_steps"), ("mixup.mode=foo", "unknown", "mixup.mode"),
        ("progress.every_n_steps=-5", "range", "progress.every_n_steps"),
    ]:
        extra = ("data.batch_size=1024",) if kind == "huge" else ()  # terabytes: more than any machine holds
        cases.append(_cli("train", kind, needle, "train", *run, "output_dir={tmp}/out", override, *extra))
    cases += [
        _cli("train", "ignored", "optim.betas", "train", *run, "output_dir={tmp}/out", "optim.opt=sgd",
             "optim.betas=[0.5,0.9]"),  # SGD has no moments
        _cli("train", "ignored", "mixup.mode", "train", *run, "output_dir={tmp}/out", "mixup.mixup_alpha=0",
             "mixup.cutmix_alpha=0", "mixup.mode=pair"),  # mixup off
        _cli("train", "existing", "finished run", "train", *run, "output_dir={run}"),
        _cli("train", "file-for-folder", "output_dir", "train", *run, "output_dir={file}"),
        _cli("train", "read-only", "ro", "train", *run, "output_dir={ro}/out"),
        _cli("train", "missing", "does not exist", "train", *run, "output_dir={tmp}/out", "resume={tmp}/nope.ckpt"),
        _cli("train", "file-for-folder", "folder", "train", *run, "output_dir={tmp}/out", "resume={run}"),
        _cli("train", "bit-flipped", "last.ckpt", "train", *run, "output_dir={unfinished}"),
        _cli("train", "truncated", "torn.ckpt", "train", *run, "output_dir={tmp}/out", "resume={torn}"),
        _cli("train", "ignored", "optim.lr", "train", *run, "output_dir={tmp}/out", "resume={last}", "optim.lr=0.0123"),
        _cli("train", "malicious", "lock", "train", *run, "output_dir={lock_run}"),
        _cli("train", "unknown", "--bogus", "train", "--bogus"),
        _cli("train", "missing", "cifar", "train", "data=cifar100", "data.root={tmp}/nowhere", "output_dir={tmp}/out"),
    ]
    return cases


def _eval_cases() -> list[Case]:
    ev = ("eval", "--ckpt", "{ckpt}", "--device", "cpu")
    cases = [_cli("eval", kind, needle, *ev, *extra) for extra, kind, needle in [
        (("--json", "{last}"), "existing", "--json"), (("--json", "{ckpt}", "--overwrite"), "existing", "--json"),
        (("--json", "{file}"), "existing", "--json"), (("--json", "{tmp}/missing/r.json"), "missing", "--json"),
        (("--json", "{ro}/r.json"), "read-only", "--json"), (("--json", "{tmp}"), "file-for-folder", "--json"),
        (("--json", "{file}/r.json"), "file-for-folder", "--json"), (("--img-size", "100000"), "huge", "--img-size"),
        (("--img-size", "16384", "data.batch_size=1024"), "huge", "img"),
        (("--img-size", "224.5"), "type", "--img-size"),
        (("--img-size", "0"), "range", "--img-size"), (("--img-size", "abc"), "type", "--img-size"),
        (("--patch-size", "0"), "range", "--patch-size"), (("--patch-size", "5"), "range", "patch"),
        (("--rescale-field",), "missing", "--rescale-field"), (("data.img_size=100000",), "huge", "img_size"),
        (("data.batch_size=0",), "range", "batch_size"), (("data.bogus=1",), "unknown", "bogus"),
        (("foo=1",), "unknown", "foo=1"), (("--ema",), "unknown", "ema"), (("data.seed=1",), "ignored", "data.seed"),
        (("--img-size", "16", "data.img_size=32"), "ignored", "data.img_size"),  # one size, from one place
    ]]
    cases += [
        _cli("eval", "unknown", "cuda", "eval", "--ckpt", "{ckpt}", "--device", "cuda"),
        _cli("eval", "unknown", "gpu", "eval", "--ckpt", "{ckpt}", "--device", "gpu"),
        _cli("eval", "unknown", "use_ema", "eval", "--ckpt", "{export}", "--ema", "--device", "cpu"),
    ]
    for key, kind, needle in [("run", "file-for-folder", "is a folder"), ("missing", "missing", "does not exist"),
                              ("torn", "truncated", "torn.ckpt"), ("empty", "truncated", "empty.ckpt"),
                              ("text", "truncated", "text.ckpt"), ("flipped", "bit-flipped", "last.ckpt"),
                              ("flipped_export", "bit-flipped", "model.safetensors"),
                              ("evil", "malicious", "evil.ckpt"),
                              ("nan_ckpt", "range", "non-finite"), ("big_cfg_ckpt", "huge", "embed_dim"),
                              ("torn_export", "truncated", "model.safetensors")]:
        cases.append(_cli("eval", kind, needle, "eval", "--ckpt", "{%s}" % key, "--device", "cpu"))
    cases += [
        _cli("eval", "malicious", "config.yaml", "eval", "--ckpt", "{bomb_run}/checkpoints/best.ckpt", "--device",
             "cpu"),
        _cli("eval", "malicious", "interpolation", "eval", "--ckpt", "{env_run}/checkpoints/best.ckpt", "--device",
             "cpu"),
    ]
    return cases


def _transfer_cases() -> list[Case]:
    tr = ("transfer", "--mode", "linear", *TINY_RUN, "data.num_classes=4")
    return [_cli("transfer", kind, needle, *tr, "output_dir={tmp}/out", "--ckpt", *extra) for extra, kind, needle in [
        (("{missing}",), "missing", "does not exist"), (("{run}",), "file-for-folder", "is a folder"),
        (("{torn}",), "truncated", "torn.ckpt"), (("{flipped}",), "bit-flipped", "last.ckpt"),
        (("{evil}",), "malicious", "evil.ckpt"), (("{ckpt}", "--mode", "bogus"), "unknown", "--mode"),
        (("{ckpt}", "data.img_size=224.5"), "type", "img_size"), (("{export}", "--use-ema"), "unknown", "use_ema"),
        (("{ckpt}", "data.batch_size=0"), "range", "batch_size"),
        (("{ckpt}", "model.kwargs.depth=2"), "ignored", "model.kwargs.depth"),  # the model is the source's
    ]] + [
        _cli("transfer", "existing", "holds a", *tr, "--ckpt", "{ckpt}", "output_dir={run}"),
        _cli("transfer", "file-for-folder", "output_dir", *tr, "--ckpt", "{ckpt}", "output_dir={file}"),
    ]


def _convert_cases() -> list[Case]:
    cv = ("convert", *TINY_CONVERT)
    cases = [_cli("convert", kind, needle, *cv, "--teacher", "{teacher}", "--out", "{tmp}/out", *extra)
             for extra, kind, needle in [
                 (("+model.kwargs.embed_dim=48",), "ignored", "model.kwargs.embed_dim"),
                 (("experiment=digits_vit_ssog",), "ignored", "experiment"),
                 (("mixup.mixup_alpha=0.5",), "ignored", "mixup"), (("convert.recipe=fast",), "unknown", "recipe"),
                 (("convert.fit_steps=-1",), "range", "fit_steps"),
                 (("convert.calib_images=0",), "range", "calib_images"),
                 (("convert.mixer=mha",), "unknown", "mixer"), (("convert.fit_lr=0",), "range", "fit_lr"),
                 (("--calib", "{tmp}/nowhere"), "missing", "--calib"),
                 (("--calib", "{file}"), "file-for-folder", "--calib"),
                 (("--timm-kwargs", "[1]"), "type", "--timm-kwargs"),
                 (("--timm-kwargs", "{{no"), "type", "--timm-kwargs"),
                 (("--timm-model", "nope_vit"), "unknown", "nope_vit"), (("data.img_size=224.5",), "type", "img_size"),
                 (("convert.recipe=logits", "convert.feature_weight=5"), "ignored", "convert.feature_weight"),
                 (("convert.steps_per_block=50",), "ignored", "convert.steps_per_block"),  # blocks: not progressive
             ]]
    cases += [_cli("convert", kind, needle, *cv, "--teacher", teacher, "--out", "{tmp}/out")
              for teacher, kind, needle in [("{missing}", "missing", "does not exist"), ("{run}", "file-for-folder",
                                                                                          "is a folder"),
                                            ("{torn}", "truncated", "torn.ckpt"), ("{evil}", "malicious", "evil.ckpt")]]
    cases += [
        _cli("convert", "existing", "train", *cv, "--teacher", "{teacher}", "--out", "{run}"),
        _cli("convert", "existing", "train", *cv, "--teacher", "{teacher}", "--out", "{unfinished}"),
        _cli("convert", "file-for-folder", "--out", *cv, "--teacher", "{teacher}", "--out", "{file}"),
    ]
    return cases


def _export_cases() -> list[Case]:
    ex = ("export", "--ckpt", "{export}", "--format", "torchscript")
    cases = [_cli("export", kind, needle, *ex, *extra) for extra, kind, needle in [
        (("--out", "{file}"), "existing", "--out"), (("--out", "{export}", "--overwrite"), "existing", "--out"),
        (("--out", "{tmp}/missing/m.pt"), "missing", "--out"), (("--out", "{ro}/m.pt"), "read-only", "--out"),
        (("--out", "{tmp}"), "file-for-folder", "--out"), (("--out", "{file}/m.pt"), "file-for-folder", "--out"),
        (("--batch", "0"), "range", "--batch"), (("--batch", "2.5"), "type", "--batch"),
        (("--batch", "100000"), "huge", "--batch"), (("--tolerance", "-1"), "range", "--tolerance"),
        (("--tolerance", "nan"), "range", "--tolerance"),
    ]]
    cases.append(_cli("export", "unknown", "--format", "export", "--ckpt", "{export}", "--format", "bogus"))
    for key, kind, needle in [("missing", "missing", "does not exist"), ("run", "file-for-folder", "is a folder"),
                              ("torn", "truncated", "torn.ckpt"),
                              ("flipped_export", "bit-flipped", "model.safetensors")]:
        cases.append(_cli("export", kind, needle, "export", "--ckpt", "{%s}" % key, "--format", "torchscript",
                          "--out", "{tmp}/m.pt"))
    return cases


def _report_cases() -> list[Case]:
    rp = ("report", "--out", "{tmp}/rep")
    cases = [_cli("report", kind, needle, *rp, target) for target, kind, needle in [
        ("{tmp}/nowhere", "missing", "nowhere"), ("{file}", "file-for-folder", "file"),
        ("{tmp}", "unknown", "config.yaml"),
        ("{bomb_run}", "malicious", "config.yaml"), ("{env_run}", "malicious", "interpolation"),
        ("{torn_csv_run}", "truncated", "metrics.csv"),
    ]]
    cases += [
        _cli("report", "file-for-folder", "--out", "report", "{run}", "--out", "{file}"),
        _cli("report", "read-only", "--out", "report", "{run}", "--out", "{ro}/rep"),
        _cli("report", "range", "--table", "report", "{run}", "--out", "{tmp}/rep", "--table", "0"),
        _cli("report", "type", "--table", "report", "{run}", "--out", "{tmp}/rep", "--table", "x"),
        _cli("report", "existing", "runs.md", "report", "{run}", "--out", "{report_out}"),
        _cli("report", "existing", "--out", "report", "{run}", "--out", "{run}/report"),  # inside a run's folder
    ]
    return cases


def _analyze_cases() -> list[Case]:
    an = ("analyze", "--model", "vit-tiny-ssog", "--model-kw", "depth=1", "--model-kw", "embed_dim=32",
          "--model-kw", "num_heads=2", "--num-images", "4", "--out", "{tmp}/an")
    cases = [_cli("analyze", kind, needle, an[0], what, *an[1:], *extra) for what, extra, kind, needle in [
        ("lipschitz", ("--iters", "0"), "range", "--iters"), ("lipschitz", ("--iters", "-1"), "range", "--iters"),
        ("lipschitz", ("--samples", "0"), "range", "--samples"), ("lipschitz", ("--radii", "-1"), "range", "--radii"),
        ("lipschitz", ("--radii", "x"), "type", "--radii"), ("sinks", ("--num-images", "0"), "range", "--num-images"),
        ("fields", ("--image-index", "99999"), "range", "--image-index"),
        ("fields", ("--image-index", "-1"), "range", "--image-index"), ("fields", ("--query", "1"), "range", "--query"),
        ("fields", ("--query", "a,b"), "type", "--query"),
        ("transfer", ("--patch-sizes", "0"), "range", "--patch-sizes"),
        ("transfer", ("--img-sizes", "100000"), "huge", "--img-sizes"), ("atoms", ("--seed", "-1"), "range", "--seed"),
        ("atoms", ("--model-kw", "depth=0"), "range", "depth"), ("atoms", ("--model-kw", "img_size=224.5"), "type",
                                                                  "img_size"),
        ("atoms", ("--model", "vit-huge-ssog"), "unknown", "vit-huge-ssog"),
        ("transfer", ("--transfer-images", "0"), "range", "--transfer-images"),
    ]]
    cases += [
        _cli("analyze", "missing", "does not exist", "analyze", "atoms", "--ckpt", "{missing}", "--out", "{tmp}/an"),
        _cli("analyze", "file-for-folder", "is a folder", "analyze", "atoms", "--ckpt", "{run}", "--out", "{tmp}/an"),
        _cli("analyze", "file-for-folder", "--out", "analyze", "atoms", "--ckpt", "{ckpt}", "--out", "{file}"),
        _cli("analyze", "read-only", "--out", "analyze", "atoms", "--ckpt", "{ckpt}", "--out", "{ro}/an"),
        _cli("analyze", "existing", "atoms.json", "analyze", "atoms", "--ckpt", "{ckpt}", "--out", "{analysis}"),
        _cli("analyze", "missing", "--ckpt", "analyze", "atoms", "--out", "{tmp}/an"),
        _cli("analyze", "ignored", "--img-sizes", "analyze", "transfer", "--ckpt", "{export}", "--img-sizes", "18",
             "--out", "{tmp}/an"),  # not a multiple of the patch 4: it was evaluated at 16 or dropped
        _cli("analyze", "ignored", "--data", "analyze", "sinks", "--ckpt", "{export}", "--data", "digits", "--out",
             "{tmp}/an"),  # the export records its own data (synthetic)
    ]
    return cases


def _other_cases() -> list[Case]:
    cases = [_cli("list", kind, needle, "list", *extra) for extra, kind, needle in [
        (("bogus",), "unknown", "bogus"), (("--table", "0"), "range", "--table"), (("--table", "x"), "type", "--table"),
        (("--table", "99"), "range", "99")]]
    main = ("main", "--out", "{tmp}/main", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1")
    cases += [_cli("main", kind, needle, *main, *extra, sub=True) for extra, kind, needle in [
        (("--epochs", "0"), "range", "--epochs"), (("--epochs", "-1"), "range", "--epochs"),
        (("--mixers", "ssog,foo"), "unknown", "foo"), (("--threads", "-1"), "range", "--threads"),
    ]]
    cases.append(_cli("main", "file-for-folder", "--out", "main", "--out", "{file}", "--epochs", "1", sub=True))
    bm = ("bench", "models", "--sizes", "tiny", "--res", "32", "--batch", "1", "--iters", "1", "--warmup", "0",
          "--blocks", "1", "--no-plots", "--device", "cpu", "--out", "{tmp}/bench")
    cases += [_cli("bench", kind, needle, *bm, *extra, sub=True) for extra, kind, needle in [
        (("--families", "bogus"), "unknown", "bogus"), (("--mixers", "bogus"), "unknown", "bogus"),
        (("--res", "0"), "range", "--res"), (("--batch", "0"), "range", "--batch"),
        (("--num-classes", "-1"), "range", "--num-classes"), (("--out", "{file}"), "file-for-folder", "--out"),
    ]]
    op = ("bench", "operator", "--res", "32", "--batch", "1", "--iters", "1", "--warmup", "0", "--blocks", "1",
          "--no-plots", "--device", "cpu", "--out", "{tmp}/bench")
    cases += [_cli("bench", kind, needle, *op, *extra, sub=True) for extra, kind, needle in [
        (("--dim", "0"), "range", "--dim"), (("--heads", "0"), "range", "--heads"),
        (("--prefix", "-1"), "range", "--prefix"), (("--patch", "0"), "range", "--patch"),
    ]]
    return cases


CASES: list[Case] = [*_model_cases(), *_mixer_cases(), *_loader_cases(), *_train_cases(), *_eval_cases(),
                     *_transfer_cases(), *_convert_cases(), *_export_cases(), *_report_cases(), *_analyze_cases(),
                     *_other_cases()]
