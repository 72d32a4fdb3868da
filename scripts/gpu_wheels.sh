#!/usr/bin/env bash
# The Python packages a lent GPU machine lacks, as wheels for its Python (3.12, manylinux x86-64), into .whl/:
#   bash scripts/gpu_wheels.sh            # engine stages: gguf only (~0.1 MB)
#   bash scripts/gpu_wheels.sh service    # + what the service imports, for the pipeline stage (~31 MB)
# scripts/gpu_session.sh installs .whl/*.whl to /tmp/site on the machine; name .whl in the call's carry.
# The machine's image already holds torch, triton, transformers, numpy, jinja2, httpx, anyio, click,
# prometheus-client and the rest of nightshift/engine/kernels/README.md's list; these are the ones it lacked on
# 2026-11-28 (the service's dependencies resolved for Python 3.12 by pip, minus the image's packages; boto3
# and botocore are needed: the workers import nightshift.storage.s3 at start). pydantic stays at 2.13: 2.14
# wants a newer typing-extensions than the image had been known to hold.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
engine=(gguf==0.19.0)
service=(alembic==1.20.1 amqp==5.4.2 annotated-types==0.8.0 billiard==4.3.2 boto3==1.44.8 botocore==1.44.8
         celery==5.7.0 click-didyoumean==0.3.1 click-plugins==1.1.1.2 click-repl==0.4.1 croniter==7.0.0
         fastapi==0.165.0 ijson==3.6.0 jmespath==1.1.0 kombu==5.7.0 llguidance==1.9.1 mako==1.4.3
         opentelemetry-api==1.45.2 orjson==3.13.0 prompt-toolkit==3.0.53 pydantic==2.13.4 pydantic-core==2.46.4
         pydantic-settings==2.16.3 python-dotenv==1.2.4 python-multipart==0.0.34 redis==8.1.0 s3transfer==0.19.3
         sqlalchemy==2.1.9 starlette==1.10.0 typing-inspection==0.4.2 tzdata==2026.6 tzlocal==5.4.5
         uvicorn==0.54.0 vine==5.1.0 wcwidth==0.9.4)
wanted=("${engine[@]}")
if [ "${1:-}" = service ]; then wanted+=("${service[@]}"); fi
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${platforms[@]}" -d .whl "${wanted[@]}"
echo "$(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
