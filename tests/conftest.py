import logging
import warnings

logging.getLogger("torchrec").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
