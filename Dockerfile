# One image for every stage; compose picks the stage with the command.
# BASE_IMAGE: any image with Python >= 3.11 and pip (e.g. python:3.11-slim, or a CUDA runtime image).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 MMCACHE_HOME=/var/cache/mmcache

WORKDIR /app
# shellcheck disable=SC2086
RUN python3 -m venv /opt/mmcache && /opt/mmcache/bin/pip install $TORCH_SPEC
ENV PATH=/opt/mmcache/bin:$PATH

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY processor ./processor
COPY encoder_stage ./encoder_stage
COPY llm_stage ./llm_stage
COPY mmcache ./mmcache
RUN pip install .

ENTRYPOINT ["mmcache"]
CMD ["serve"]
