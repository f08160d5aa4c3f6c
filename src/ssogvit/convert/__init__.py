"""Turn a trained multi-head-attention ViT into an SSoG ViT (docs/conversion.md).

    from ssogvit.convert import load_teacher, build_student, fit_fields, format_report, plot_fit
    teacher = load_teacher("runs/digits_vit_mha/export/model.safetensors")
    student = build_student(teacher, mixer="ssog")          # every weight but queries and keys carried over
    fit = fit_fields(teacher, student, images)               # each head's Gaussians fitted to the teacher's attention
    print(format_report(fit)); plot_fit(fit, "fields.png")   # how Gaussian is this ViT?

then distil with ``ConversionModule`` (recipes ``RECIPES``), or run it all with ``convert(cfg)`` / ``ssogvit convert``.
"""

from .distill import DEFAULT_RECIPE, RECIPES, ConversionModule, relative_error
from .fit import FitResult, fit_fields, fit_mixer, format_report, plot_fit
from .run import calibration_images, convert, output_folder
from .student import attention_probs, build_student, check_teacher, load_converted, load_teacher, record_mixer_inputs

__all__ = [
    "DEFAULT_RECIPE", "RECIPES", "ConversionModule", "FitResult", "attention_probs", "build_student",
    "calibration_images", "check_teacher", "convert", "fit_fields", "fit_mixer", "format_report",
    "load_converted", "load_teacher", "output_folder", "plot_fit", "record_mixer_inputs", "relative_error",
]
