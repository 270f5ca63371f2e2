"""kvbench adapter for this project: the Python binding behind kvbench's Mooncake adapter.

    PYTHONPATH=scripts:../shared/peer python ../shared/peer/kvbench.py run \
        --adapter kvbench_mooncake_rs:MooncakeRsAdapter --adapter-args '{"master": "127.0.0.1:50051"}'

The binding mirrors MooncakeDistributedStore, so kvbench drives both stores through the same code
path; only construction differs (no metadata server, the class to load, the version reported).
"""

from kvbench import MooncakeAdapter


class MooncakeRsAdapter(MooncakeAdapter):
    name = "mooncake-rs"

    def __init__(self, master="127.0.0.1:50051", local_hostname="127.0.0.1", global_segment_size=0,
                 force_remove=True, **ignored):
        super().__init__(local_hostname=local_hostname, metadata_server="", master=master, protocol="tcp",
                         global_segment_size=global_segment_size, force_remove=force_remove,
                         store_class="mooncake_rs.store:MooncakeDistributedStore")

    def describe(self):
        import mooncake_rs

        d = super().describe()
        d["adapter"] = self.name
        d["package_version"] = mooncake_rs.__version__
        return d
