# The Prefect worker image: lrkv installed (CPU torch by default; pass --build-arg TORCH_INDEX for CUDA).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /opt/lrkv
COPY . .
RUN pip install --no-cache-dir torch --index-url ${TORCH_INDEX} && pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
