#!/usr/bin/env bash
# Evidence for docs/conversion.md: the digits teacher, then (per seed) the SSoG model trained from scratch with the
# full recipe and each conversion recipe, validated every 11 optimizer steps (half an epoch at batch 64).
#   scripts/convert_evidence.sh teacher|scratch|convert [SEEDS...]   (ROOT=/tmp/i13, RECIPES='blocks logits progressive')
# Each step is one short process with one torch thread; run the parts side by side at most two at a time.
set -euo pipefail
ROOT=${ROOT:-/tmp/i13}
PY=${PY:-python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
what=$1; shift
case $what in
  teacher)
    $PY -m ssogvit train experiment=digits_vit_mha data.img_size=32 output_dir=$ROOT/teacher \
      trainer.enable_progress_bar=false ;;
  scratch)
    for seed in "${@:-0 1 2}"; do
      $PY -m ssogvit train experiment=digits_vit_ssog data.img_size=32 seed=$seed output_dir=$ROOT/scratch/s$seed \
        resume=null trainer.max_epochs=30 data.num_workers=0 trainer.enable_progress_bar=false \
        +trainer.val_check_interval=11 export.safetensors=false
    done ;;
  convert)
    for seed in "${@:-0 1 2}"; do
      for recipe in ${RECIPES:-blocks logits progressive}; do
        # TAG names a variant given by the overrides in EXTRA (e.g. TAG=_fieldlr30 EXTRA=convert.field_lr_scale=30)
        $PY -m ssogvit convert --teacher $ROOT/teacher/export/model.safetensors \
          --out $ROOT/convert/$recipe${TAG:-}/s$seed convert.recipe=$recipe seed=$seed data.num_workers=0 \
          trainer.enable_progress_bar=false +trainer.val_check_interval=11 ${EXTRA:-}
      done
    done ;;
  *) echo "unknown part $what" >&2; exit 2 ;;
esac
