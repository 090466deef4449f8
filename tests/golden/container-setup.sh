# The deployment guide, §2 打补丁 (准备工作, vllm-ascend patches) and §3 安装 openYuanrong Datasystem (its
# commands, verbatim, in the order given; the prose between them left out), run in `docker exec -it ds_v4_flash_yr bash`.

mkdir -p /workspace/yuanrong_patches

git config --global user.email "deploy@local"
git config --global user.name "deploy"
# vllm-ascend patches

cd /vllm-workspace/vllm-ascend
git am /workspace/yuanrong_patches/0001-feat-kv-pool-support-load-failure-block-ids-for-yuan.patch

wget https://gitcode.com/openeuler/yuanrong-datasystem/releases/download/v0.7.6.rc1/openyuanrong_datasystem-0.7.6rc1-cp311-cp311-manylinux_2_35_aarch64.whl

pip install openyuanrong_datasystem-0.7.6rc1-cp311-cp311-manylinux_2_35_aarch64.whl

python -c "import yr.datasystem; print('openYuanrong Datasystem 安装成功')"
