# One image for every stage; the command picks the stage (compose.yaml, deploy/kubernetes/).
# BASE_IMAGE: any image with Python >= 3.11, venv and pip: python:3.11-slim, a CUDA runtime image,
# or, where no registry answers, the debootstrap image `scripts/docker-engine start` builds.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch and torchvision must be a matching pair (docs/deployment.md).
ARG TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 MMCACHE_HOME=/var/cache/mmcache

WORKDIR /app
# The shared KV tier's store (compose's kvstore service, deploy/kubernetes/kvstore.yaml) runs this
# image with Debian's redis-server (redis-cli for its health check). gcc: the LLM stage compiles its
# CPU kernels for the CPU it runs on, at first use (shared/cpu_kernels.py).
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        redis-server redis-tools gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# triton (0.9 GB) is torch's kernel compiler, which mmcache never calls: every copy of the image
# (each Swarm node holds one) is smaller without it. Removed in the layer that installs it.
# shellcheck disable=SC2086
RUN python3 -m venv /opt/mmcache && /opt/mmcache/bin/pip install $TORCH_SPEC \
    && /opt/mmcache/bin/pip uninstall -y -q triton
# Large tensors on transparent huge pages (torch reads it at its first large allocation): the
# weight products of a decode step ran ~10% faster (docs/performance.md, thread placement).
ENV PATH=/opt/mmcache/bin:$PATH THP_MEM_ALLOC_ENABLE=1

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY processor ./processor
COPY encoder_stage ./encoder_stage
COPY llm_stage ./llm_stage
COPY benchmarks ./benchmarks
# mmcache/ holds symlinks to the folders above (mmcache/shared -> ../shared, ...): everything installs
# under the one top-level package `mmcache` (pyproject.toml: [tool.setuptools.package-dir]).
COPY mmcache ./mmcache
# The tiny test checkpoint is generated here, deterministically: every node that loads this image
# has the same weights at /model without a shared volume. A real checkpoint is bind-mounted over it.
RUN pip install . && pip uninstall -y -q triton && mmcache make-tiny-model /model \
    && rm -rf /root/.cache

EXPOSE 8000 5556 5557
ENTRYPOINT ["mmcache"]
CMD ["serve", "--model", "/model", "--host", "0.0.0.0"]
